"""One self-contained HTML report: CSS inline, figures as inline PNG, no script, nothing fetched.

Every string taken from a trace (module and parameter names, the model summary, the host)
comes from user code or a bug ticket: the templates autoescape all of it and mark none safe.
One template per part of the report (header, verdict, findings, overview, appendix).
"""

from __future__ import annotations

import os

import jinja2

from ..analyzer.findings import Finding
from ..analyzer.trace import Trace
from .build import build_report
from .model import Report
from .plots import png_data_uri

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters["data_uri"] = png_data_uri


def render_html(report_or_trace: Report | Trace, findings: list[Finding] | None = None) -> str:
    """The HTML of a built report, or of ``trace`` and its ``findings`` (built here)."""
    report = report_or_trace if isinstance(report_or_trace, Report) else build_report(report_or_trace, findings or [])
    return _ENV.get_template("report.html.j2").render(r=report)
