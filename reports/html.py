"""One self-contained HTML report: CSS inline, figures as inline PNG, nothing fetched.

Every string taken from a trace (module and parameter names, the model summary, the host)
comes from user code or a bug ticket: the template autoescapes all of it and marks none safe.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import jinja2
import numpy as np

from .. import __version__
from ..analyzer.findings import Finding
from ..analyzer.trace import RankTrace, Trace
from . import plots
from .summary import run_facts, verdict

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
# Evidence is shown in full up to these bounds; a trace could hold a dict of every parameter.
_MAX_EVIDENCE_ITEMS = 40
_MAX_EVIDENCE_DEPTH = 3
_MAX_TEXT_CHARS = 4000


@dataclass(frozen=True)
class FigureBlock:
    title: str
    caption: str
    image: str | None  # a data: URI, or None when there was nothing to draw (caption says why)


def render_html(trace: Trace, findings: list[Finding]) -> str:
    """The report of ``trace`` and its ``findings`` (sorted as the analyzer returns them)."""
    return _ENV.get_template("report.html.j2").render(
        version=__version__,
        run_dir=trace.run_dir,
        facts=run_facts(trace),
        verdict=verdict(findings),
        findings=[_finding_view(f) for f in findings],
        figures=[_loss_figure(trace, findings), _grad_norm_figure(trace, findings)],
        model_summary=str(_first(trace).meta.get("model_summary", "")),
    )


# -- findings -------------------------------------------------------------------------------------
def _finding_view(f: Finding) -> dict:
    return {
        "kind": f.kind,
        "severity": f.severity,
        "rank": f.rank,
        "step": f.step,
        "where": [w if w else "(the model itself)" for w in f.where],
        "summary": f.summary,
        "evidence": evidence_rows(f.evidence),
        "advice": f.advice,
    }


def evidence_rows(evidence: dict, depth: int = 0) -> list[tuple[str, object]]:
    """``[(key, value)]`` where each value is a string or, for a nested dict, rows again."""
    items = list(evidence.items())
    rows = [(str(k), _evidence_value(v, depth)) for k, v in items[:_MAX_EVIDENCE_ITEMS]]
    if len(items) > _MAX_EVIDENCE_ITEMS:
        rows.append(("…", f"{len(items) - _MAX_EVIDENCE_ITEMS} more entries not shown"))
    return rows


def _evidence_value(v, depth: int):
    if isinstance(v, dict) and v and depth < _MAX_EVIDENCE_DEPTH:
        return evidence_rows(v, depth + 1)
    return format_value(v)


def format_value(v) -> str:
    """A number or small structure as a reader wants it: 4 significant digits, NaN/Inf named."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Inf" if v > 0 else "-Inf"
        return f"{v:.0f}" if 1e4 <= abs(v) < 1e6 else f"{v:.4g}"  # 12346, not 1.235e+04
    if isinstance(v, (list, tuple)):
        shown = ", ".join(format_value(x) for x in v[:_MAX_EVIDENCE_ITEMS])
        more = f", … ({len(v)} items)" if len(v) > _MAX_EVIDENCE_ITEMS else ""
        return f"[{shown}{more}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {format_value(x)}" for k, x in v.items()) + "}"
    text = str(v)
    return text if len(text) <= _MAX_TEXT_CHARS else text[:_MAX_TEXT_CHARS] + " …(truncated)"


# -- figures --------------------------------------------------------------------------------------
def _marks(findings: list[Finding], rank: int | None = None) -> list[tuple[int, str, str]]:
    """(step, severity, label) of each finding with a step, on ``rank`` if given; no repeats."""
    seen: dict[tuple[int, str], tuple[int, str, str]] = {}
    for f in findings:
        if f.step is not None and (rank is None or f.rank in (None, rank)):
            seen.setdefault((f.step, f.kind), (f.step, f.severity, f"{f.kind}, step {f.step}"))
    return list(seen.values())


def _loss_figure(trace: Trace, findings: list[Finding]) -> FigureBlock:
    title = "Loss"
    multi = len(trace.ranks) > 1
    losses = {(f"rank {r}" if multi else "loss"): rt.steps["loss"] for r, rt in trace.ranks.items()}
    if not any(np.isfinite(s.to_numpy()).any() for s in losses.values()):
        return FigureBlock(title, "No finite loss was recorded (was rec.step() called with loss=?).", None)
    caption = ("Loss per step. Dotted vertical lines mark the first step of each finding; "
               "gaps are steps whose loss was NaN or Inf.")
    return FigureBlock(title, caption, plots.png_data_uri(plots.plot_loss, losses, marks=_marks(findings)))


def _grad_norm_figure(trace: Trace, findings: list[Finding]) -> FigureBlock:
    rt = _focus_rank(trace, findings)
    title = "Gradient norm per layer" + (f" (rank {rt.rank})" if len(trace.ranks) > 1 else "")
    weights = [n for n, shape in zip(rt.param_names, rt.param_shapes) if len(shape) >= 2]
    names = weights or rt.param_names
    if rt.n_steps == 0 or not names:
        return FigureBlock(title, "No gradient norms were recorded.", None)
    grad_norm = rt.param_stat("grad_norm")[names]
    named = [w for f in findings if f.rank in (None, rt.rank) for w in f.where]
    drawn = plots.largest_columns(grad_norm, plots.MAX_LINES, keep=named)
    if not drawn:
        return FigureBlock(title, "No finite, non-zero gradient norm was recorded.", None)
    drawn_set = set(drawn)
    left_out = [n for n in names if n not in drawn_set]
    image = plots.png_data_uri(plots.plot_grad_norms, grad_norm[drawn], total=rt.total_grad_norm,
                               marks=_marks(findings, rt.rank), figsize=(10, 4.2))
    kind = "weight matrices and kernels (parameters of 2 or more dimensions)" if weights else "parameters"
    caption = (f"L2 norm of the gradient of each of the {len(names)} {kind}, per step, log scale; "
               "dashed black: the norm of all gradients together. Zero, NaN and Inf norms leave gaps.")
    if left_out:
        caption += (f" Only {len(drawn)} are drawn: those the findings name, then the largest; "
                    f"not drawn: {len(left_out)} ({', '.join(left_out[:10])}"
                    f"{', …' if len(left_out) > 10 else ''}).")
    return FigureBlock(title, caption, image)


def _focus_rank(trace: Trace, findings: list[Finding]) -> RankTrace:
    """The rank of the first finding that names one, else the lowest rank."""
    for f in findings:
        if f.rank in trace.ranks:
            return trace.ranks[f.rank]
    return _first(trace)


def _first(trace: Trace) -> RankTrace:
    return next(iter(trace.ranks.values()))
