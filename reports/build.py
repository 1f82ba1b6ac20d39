"""Build a report once (facts, verdict, findings with their figures, overview, appendix) as plain
data; html.py and pdf.py only lay it out. Bounded whatever the run: at most MAX_FULL_FINDINGS
findings in full, MAX_FIGURES finding figures, MAX_WHERE names per finding, tables cut to
appendix.MAX_ROWS rows, heatmaps to overview.HEATMAP_ROWS x HEATMAP_COLS, lines to
plots.MAX_POINTS points each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .. import __version__
from ..analyzer.config import AnalysisConfig
from ..analyzer.findings import Finding, not_checked, sort_findings
from ..analyzer.restarts import attempt_view
from ..analyzer.trace import Trace
from . import appendix, distributions, overview, ranks
from .context import Context, no_figure
from .format import bounded, evidence_rows, shorten
from .model import Figure, FindingView, Report, Table
from .sections import section
from .summary import build_verdict, recorder_settings, run_facts, run_line

MAX_FULL_FINDINGS = 30
MAX_FIGURES = 16
MAX_WHERE = 20

# progress(done, total, what is being done now)
Progress = Callable[[int, int, str], None]


def build_report(trace: Trace, findings: list[Finding], cfg: AnalysisConfig | None = None,
                 progress: Progress | None = None) -> Report:
    """The report of ``trace`` and its ``findings``: most severe first, then by step."""
    everything = sort_findings(findings)
    findings = [f for f in everything if not not_checked(f)]  # (the verdict says those in one line)
    ctx = Context(trace, findings, cfg or AnalysisConfig())
    shown = findings[:MAX_FULL_FINDINGS]
    anchors = {id(f): f"finding-{i + 1}" for i, f in enumerate(shown)}

    figures: dict[int, Figure | None] = {}
    tasks: list[tuple[str, Callable[[], object]]] = []
    shared: dict[tuple[str, int | None], Finding] = {}  # (kind, rank) -> the finding whose figure serves all
    for i, f in enumerate(shown):
        if i >= MAX_FIGURES or f.step is None:
            continue
        if getattr(section(f.kind), "SHARED_FIGURE", False):
            first = shared.setdefault((f.kind, f.rank), f)
            if first is not f:
                where = f" ({first.where[0] or '(model)'})" if first.where else ""
                figures[i] = no_figure("", f"The figure of the {f.kind} finding above{where} shows this "
                                           f"one too: it draws every activation these findings name.")
                continue
        tasks.append((f"figure: {f.kind}", lambda i=i, f=f: figures.__setitem__(i, _finding_figure(ctx, f))))
    overview_figs: list[Figure] = []
    for name in overview.FIGURES:
        tasks.append((f"overview: {name}", lambda name=name: overview_figs.extend(f for f in [_safe_figure(
            name, lambda: overview.build(ctx, name))] if f is not None)))
    tasks.append(("overview: distributions", lambda: overview_figs.extend(_safe_figures(
        "distributions", lambda: distributions.figures(ctx) + distributions.snapshot_figures(ctx)))))
    rank_figs: list[Figure] = []
    rank_table: list[Table] = []
    tasks.append(("ranks", lambda: rank_figs.extend(_safe_figures("ranks", lambda: ranks.figures(ctx)))))
    tasks.append(("ranks: how each ends", lambda: rank_table.extend(t for t in [ranks.end_table(ctx)] if t)))
    tables: list[Table] = []
    tasks.append(("appendix: parameters", lambda: tables.append(appendix.parameter_table(ctx))))
    tasks.append(("appendix: modules", lambda: tables.append(appendix.module_table(ctx))))
    tasks.append(("appendix: memory peak", lambda: tables.extend(t for t in [appendix.memory_peak_table(ctx)] if t)))
    tasks.append(("appendix: CUDA memory sites",
                  lambda: tables.extend(t for t in [appendix.cuda_memory_sites_table(ctx)] if t)))
    tasks.append(("appendix: profiler", lambda: tables.extend(t for t in [appendix.profile_table(ctx)] if t)))
    for done, (label, run) in enumerate(tasks):
        if progress:
            progress(done, len(tasks), label)
        run()
    if progress:
        progress(len(tasks), len(tasks), "done")

    views = []
    for i, f in enumerate(shown):
        fig = figures.get(i)
        if fig is None and i >= MAX_FIGURES and f.step is not None:
            fig = no_figure("", f"No figure: only the first {MAX_FIGURES} findings of a report have one.")
        views.append(FindingView(
            anchor=anchors[id(f)], kind=f.kind, severity=f.severity, step=f.step,
            rank=f.rank if len(trace.ranks) > 1 else None,
            where=tuple(f.where[:MAX_WHERE]), where_more=max(0, len(f.where) - MAX_WHERE),
            code=_code_places(f.where[:MAX_WHERE], f.evidence),
            summary=f.summary, evidence=evidence_rows(f.evidence), advice=f.advice, figure=fig))
    verdict = build_verdict(everything, len(trace.ranks), anchors)
    first = next((v for v in views if v.anchor == verdict.first_anchor), None)
    if first is not None and first.figure is not None and first.figure.png:
        verdict = replace(verdict, figure=first.figure)  # the first cause's figure, on the first screen
    # Every string of the report cut to a size its renderers can lay out (names from the trace may
    # be 100,000 characters); the model summary is cut line by line by appendix.model_summary.
    report = bounded(Report(
        title=f"torchautopsy report: {trace.run_dir}",
        run_dir=trace.run_dir,
        version=__version__,
        run_line=run_line(trace, endings=False),
        facts=run_facts(trace),
        settings=recorder_settings(trace),
        verdict=verdict,
        findings=views,
        more_findings=_more_findings(findings[MAX_FULL_FINDINGS:]),
        overview=overview_figs,
        tables=tables,
        recorded=appendix.recorded(ctx),
        model_summary="",
        ranks=tuple(rank_figs),
        rank_table=rank_table[0] if rank_table else None,
    ))
    return replace(report, model_summary=appendix.model_summary(ctx))


def _finding_figure(ctx: Context, f: Finding) -> Figure | None:
    view = attempt_view(ctx.trace, f)  # a restarted rank: drawn from the finding's own attempt
    ctx = ctx if view is ctx.trace else replace(ctx, trace=view, _cache={})
    return _safe_figure(f.kind, lambda: section(f.kind).figure_for(ctx, f))


def _safe_figure(what: str, build: Callable[[], Figure | None]) -> Figure | None:
    """A figure whose data cannot be prepared says so; the rest of the report still comes."""
    try:
        return build()
    except Exception as e:
        return no_figure(what, f"This figure could not be drawn ({type(e).__name__}: {e}); "
                               "please report it with this trace.")


def _safe_figures(what: str, build: Callable[[], list[Figure]]) -> list[Figure]:
    try:
        return build()
    except Exception as e:
        return [no_figure(what, f"These figures could not be drawn ({type(e).__name__}: {e}); "
                                "please report it with this trace.")]


def _more_findings(rest: list[Finding]) -> Table | None:
    if not rest:
        return None
    rows = [(f.severity, f.kind, "" if f.step is None else f"{f.step:,}", "" if f.rank is None else str(f.rank),
             shorten(", ".join(w or "(model)" for w in f.where[:3]) + (" …" if len(f.where) > 3 else ""), 80),
             shorten(f.summary, 240)) for f in rest]
    return Table(f"{len(rest):,} more findings", "One line each; the JSON report (--json) holds them in full.",
                 ("severity", "kind", "step", "rank", "where", "summary"), rows,
                 (False, False, True, True, False, False), widths=(9, 16, 7, 5, 22, 41))


def _code_places(where: list[str], evidence) -> tuple[str, ...]:
    """Where each name's code is (evidence["code"]), "" where not known or said just before (two
    parameters of one module)."""
    code = evidence.get("code") if isinstance(evidence, dict) else None
    if not isinstance(code, dict):
        return ()
    out, last = [], None
    for w in where:
        place = str(code.get(w, ""))
        out.append("" if place == last else place)
        last = place or last
    return tuple(out)
