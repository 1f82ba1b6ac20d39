"""Reports: a trace and its findings rendered as documents; reports never decide a verdict.

    from torchautopsy.reports import build_report, render_html, render_pdf, render_markdown
    report = build_report(trace, findings)   # once: facts, verdict, figures, tables
    html = render_html(report)               # one self-contained HTML file (str)
    pdf = render_pdf(report)                 # the same content, paginated (bytes)
    md = render_markdown(trace, findings)    # short enough to paste into a ticket
"""

from .build import build_report
from .html import render_html
from .markdown import render_markdown
from .pdf import render_pdf

__all__ = ["build_report", "render_html", "render_markdown", "render_pdf"]
