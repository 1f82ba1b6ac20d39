"""`diff --html`: one self-contained HTML page (CSS inline, figures as inline PNG, no script):
the verdict, diff_figures.py's figures (A and B overlaid with the parting step marked, the layers x
steps picture of log10(B / A)), the setup differences and the findings only one run has. Names
from the traces are autoescaped by the template, as in the analyzer's report."""

from __future__ import annotations

import os

import jinja2

from ..analyzer.diff import DiffResult
from .diff_figures import diff_figures
from .diff_text import _finding_line, _value
from .model import Figure
from .plots import png_data_uri

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                          autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_ENV.filters["data_uri"] = png_data_uri


def setup_rows(r: DiffResult) -> list[tuple[str, str, str]]:
    """The setup differences as (name, A, B) text: the HTML's and the PDF's table."""
    return [(s["name"], _value(s["a"]), _value(s["b"])) for s in r.setup]


def new_finding_lines(r: DiffResult, key: str) -> list[str]:
    """The findings only run ``key`` ("a" or "b") has, one line each: the HTML's and the PDF's."""
    return [_finding_line(f) + ": " + f.summary for f in r.new_findings.get(key, [])]


def render_diff_html(r: DiffResult, a_dir: str, b_dir: str, figures: list[Figure] | None = None) -> str:
    """The page; ``figures``: diff_figures(r), when the caller drew them already (for the PDF too)."""
    figures = diff_figures(r) if figures is None else figures
    return _ENV.get_template("diff.html.j2").render(
        a_dir=a_dir, b_dir=b_dir, a_rank=r.a.rank, b_rank=r.b.rank, a_steps=r.a.n_steps, b_steps=r.b.n_steps,
        verdict=r.verdict(), parted=r.parted is not None, identical=r.identical, figures=figures,
        setup=setup_rows(r), new_a=new_finding_lines(r, "a"), new_b=new_finding_lines(r, "b"))
