"""Reports: a trace and its findings rendered as documents; reports never decide a verdict.

    from torchautopsy.reports import render_html, render_markdown
    html = render_html(trace, findings)      # one self-contained HTML file
    md = render_markdown(trace, findings)    # short enough to paste into a ticket
"""

from .html import render_html
from .markdown import render_markdown

__all__ = ["render_html", "render_markdown"]
