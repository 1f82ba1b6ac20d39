"""Reports: a trace and its findings rendered as documents; reports never decide a verdict.

    from torchautopsy.reports import build_report, render_html, render_pdf, render_markdown
    report = build_report(trace, findings)   # once: facts, verdict, figures, tables
    html = render_html(report)               # one self-contained HTML file (str)
    pdf = render_pdf(report)                 # the same content, paginated (bytes)
    md = render_markdown(trace, findings)    # short enough to paste into a ticket

The terminal's lines (``torchautopsy analyze`` and ``info``) are in reports.terminal. The names
above are imported when first used: the CLI imports reports.terminal on every run, and must not
pull in matplotlib, jinja and fpdf2 unless a report is asked for.
"""

from importlib import import_module

__all__ = ["build_report", "render_html", "render_markdown", "render_pdf"]
_MODULES = {"build_report": "build", "render_html": "html", "render_markdown": "markdown", "render_pdf": "pdf"}


def __getattr__(name):
    if name in _MODULES:
        return getattr(import_module(f".{_MODULES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
