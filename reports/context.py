"""What every section builder needs: the trace, the findings, the thresholds, and reads of the
trace made once per report (a statistic read for one figure is reused by the next)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..analyzer.config import AnalysisConfig
from ..analyzer.errors import TraceError
from ..analyzer.findings import Finding
from ..analyzer.trace import UNMEASURED_IS_NEGATIVE, RankTrace, Trace, measured_rows
from ..analyzer.trace.gradients import weight_tensors
from . import plots
from .model import Figure

# A run longer than this is shown, in a finding's own figure, around its step: this many steps
# before it and a fifth as many after (the overview shows the whole run).
ZOOM_STEPS = 1000
# A figure of more steps than this reads each bucket's min and max instead of every step: a
# long run is never read whole into memory, and no spike is lost (plots bucket anyway).
FIGURE_STEPS = 4000
FIGURE_BUCKETS = 1000


@dataclass
class Context:
    trace: Trace
    findings: list[Finding]
    cfg: AnalysisConfig
    _cache: dict = field(default_factory=dict)

    # -- reads, cached ----------------------------------------------------------------------------
    def rank(self, rank: int | None) -> RankTrace:
        return self.trace.ranks.get(rank, self.focus) if rank is not None else self.focus

    @property
    def focus(self) -> RankTrace:
        """The rank of the first finding that names one, else the lowest rank."""
        for f in self.findings:
            if f.rank in self.trace.ranks and f.severity != "info":
                return self.trace.ranks[f.rank]
        return next(iter(self.trace.ranks.values()))

    def _cached(self, key, read: Callable):
        if key not in self._cache:
            self._cache[key] = read_or_none(read)
        return self._cache[key]

    def param(self, rt: RankTrace, stat: str, span: tuple[float, float] | None = None) -> pd.DataFrame:
        """Steps x parameters of the steps in ``span`` (default: the whole run), for a figure:
        every step, or for a long stretch the min/max envelope of each bucket (see _envelope)."""
        return self._cached((rt.rank, "param", stat, span),
                            lambda: _per_step(rt, f"params/{stat}", rt.param_names, span,
                                              lambda rows: rt.param_stat(stat, rows=rows)))

    def module(self, rt: RankTrace, span: tuple[float, float] | None = None) -> pd.DataFrame:
        """Steps x modules (labelled: the root is '(model)') of max |output|, as param()."""
        return self._cached((rt.rank, "module", span),
                            lambda: _per_step(rt, "modules/output_absmax", rt.module_labels, span,
                                              lambda rows: rt.module_rows(rows=rows)))

    def updates(self, rt: RankTrace) -> pd.DataFrame | None:
        """Sampled steps x parameters of the update-to-weight ratio (an envelope when long)."""
        def read():
            steps = rt.sample_steps("updates")
            if len(steps) <= FIGURE_STEPS:
                return rt.update_ratio()
            return _envelope(rt, "updates/ratio", steps, slice(0, len(steps)), rt.param_names)
        return self._cached((rt.rank, "upd"), read)

    def attention(self, rt: RankTrace, stat: str) -> pd.DataFrame | None:
        return self._cached((rt.rank, "attn", stat), lambda: rt.attention_stat(stat))

    def dead_shares(self, rt: RankTrace) -> pd.DataFrame | None:
        """Windows x activation sites: the share of each site's units never positive in the
        window (NaN where the site ran in under half of the window's watched steps). Index: the
        window's last step; ``attrs["window_starts"]``: its first. Streams over windows: memory
        bounded by the number of units."""
        # judged as the detector judges them: sites seen on min_seen_share of a window's watched steps
        return self._cached((rt.rank, "dead"), lambda: _dead_shares(rt, self.cfg.dead_relu.min_seen_share))

    def weights(self, rt: RankTrace) -> list[str]:
        """Weight matrices and kernels (2+ dimensions), or every parameter if there are none."""
        return [rt.param_names[j] for j in weight_tensors(rt)] or list(rt.param_names)

    # -- what figures share -----------------------------------------------------------------------
    def span(self, rt: RankTrace) -> tuple[float, float] | None:
        idx = rt.step_index
        return (float(idx[0]), float(idx[-1])) if len(idx) > 1 else None

    def window(self, rt: RankTrace, step: int | None) -> tuple[tuple[float, float] | None, str]:
        """The steps a finding's figure shows, and a caption note when that is not the whole run."""
        full = self.span(rt)
        if full is None or step is None or full[1] - full[0] <= ZOOM_STEPS * 1.2:
            return full, ""
        lo = max(full[0], step - ZOOM_STEPS)
        hi = min(full[1], step + ZOOM_STEPS // 5)
        return (lo, hi), f" Steps {int(lo):,}-{int(hi):,} around the event; the overview shows the whole run."

    def marks(self, rank: int | None = None, only: Finding | None = None, kind: str | None = None,
              labels: bool = True) -> list[plots.Mark]:
        """(step, severity, label, marker) of each finding with a step (on ``rank``, of ``kind``
        if given; only ``only`` if given); no repeats. Without ``labels`` they stay out of legends."""
        chosen = [only] if only is not None else self.findings
        seen: dict[tuple[int, str], plots.Mark] = {}
        for f in chosen:
            if f.step is not None and (rank is None or f.rank in (None, rank)) and kind in (None, f.kind):
                label = f"{f.kind}, step {f.step:,}" if labels else ""
                seen.setdefault((f.step, f.kind), (f.step, f.severity, label, self.marker(f.kind)))
        return list(seen.values())

    def marker(self, kind: str) -> str:
        """The kind's marker: the kinds in the order the report lists their findings."""
        kinds = list(dict.fromkeys(f.kind for f in self.findings))
        return plots.MARKERS[kinds.index(kind) % len(plots.MARKERS)] if kind in kinds else plots.MARKERS[0]

    def title_rank(self, title: str, rank: int | None) -> str:
        return f"{title} (rank {rank})" if len(self.trace.ranks) > 1 and rank is not None else title


def read_or_none(read: Callable):
    """read(), or None if that part of the trace cannot be read: a report draws it as "not
    recorded" instead of failing."""
    try:
        return read()
    except TraceError:
        return None


def figure(title: str, caption: str, plot: Callable, *args, height_in: float = 2.8, **kwargs) -> Figure:
    """Draw a figure; a figure that fails to draw says so instead of breaking the report."""
    try:
        png = plots.render_png(plot, *args, height_in=height_in, **kwargs)
    except Exception as e:  # a bug in one figure must not lose the rest of the report
        return Figure(title, f"{caption} (This figure could not be drawn: {type(e).__name__}: {e}.)", None)
    return Figure(title, caption, png, plots.FIG_WIDTH_IN, height_in)


def undrawn(named, drawn) -> str:
    """A caption note for the names a finding gives that a log-scale figure could not draw."""
    left = [n for n in dict.fromkeys(named) if n not in set(drawn)]
    if not left:
        return ""
    shown = ", ".join(n or "(model)" for n in left[:5]) + (" …" if len(left) > 5 else "")
    return (f" Named by the finding but not drawn, having no finite non-zero value to place on a log "
            f"scale (exactly 0, or NaN/Inf throughout): {shown}.")


def no_figure(title: str, why: str) -> Figure:
    return Figure(title, why, None)


def rows_between(frame: pd.DataFrame, span: tuple[float, float] | None) -> pd.DataFrame:
    if span is None:
        return frame
    idx = frame.index.to_numpy()
    return frame.iloc[(idx >= span[0]) & (idx <= span[1])]


def first_nonfinite(frame: pd.DataFrame, columns, after: float | None = None) -> list[tuple[float, str]]:
    """(step, column) of the first NaN/Inf of each column (at or after ``after``)."""
    out = []
    idx = frame.index.to_numpy()
    for c in columns:
        v = frame[c].to_numpy(dtype=np.float64)
        bad = ~np.isfinite(v) & (v != -1)  # -1: module not called (not a NaN)
        if after is not None:
            bad &= idx >= after
        hits = np.flatnonzero(bad)
        if hits.size:
            out.append((float(idx[hits[0]]), str(c)))
    return out


def _per_step(rt: RankTrace, name: str, columns, span, read_rows) -> pd.DataFrame:
    rows = rt.rows_in_span(*span) if span is not None else slice(0, rt.n_steps)
    if rows.stop - rows.start <= FIGURE_STEPS:
        frame = read_rows(rows)
        if name in UNMEASURED_IS_NEGATIVE:  # only the steps it was measured on (watched steps)
            frame = frame[measured_rows(frame.to_numpy())]
        return frame
    return _envelope(rt, name, rt.step_index, rows, columns)


def _envelope(rt: RankTrace, name: str, steps: np.ndarray, rows: slice, columns) -> pd.DataFrame:
    """A long steps x tensors stretch as two rows per bucket of steps: each column's largest
    value (at the bucket's first step), then its smallest (at its middle step). A NaN/Inf in a
    bucket is kept as the largest value (NaN), so figures still show where values went bad."""
    edges = np.unique(np.linspace(rows.start, rows.stop, FIGURE_BUCKETS + 1).astype(np.int64))
    b = rt.bucketed(name, edges)
    hi = np.where(b["nonfinite"], np.nan, b["max"])
    data = np.empty((2 * len(hi), hi.shape[1]))
    data[0::2], data[1::2] = hi, b["min"]
    idx = np.empty(2 * len(hi), dtype=np.int64)
    idx[0::2] = steps[edges[:-1]]
    idx[1::2] = steps[(edges[:-1] + edges[1:]) // 2]
    frame = pd.DataFrame(data, index=pd.Index(idx, name="step"), columns=list(columns))
    frame.attrs["envelope"] = True
    return frame


def _dead_shares(rt: RankTrace, min_seen_share: float) -> pd.DataFrame | None:
    sites = rt.activity_sites
    if len(sites) == 0:
        return None
    labels = [_site_label(m, fn, c) for m, fn, c in zip(sites["module"], sites["function"], sites["call"])]
    counts = Counter(labels)
    labels = [lab if counts[lab] == 1 else f"{lab} [{i}]" for i, lab in enumerate(labels)]
    rows, starts, ends = [], [], []
    for start, end, judged, _, share in rt.dead_unit_windows(sites, min_seen_share):
        rows.append(np.where(judged, share, np.nan))  # judged as the detector judges them
        starts.append(start)
        ends.append(end)
    if not rows:
        return None
    frame = pd.DataFrame(rows, index=pd.Index(ends, name="step"), columns=labels)
    frame.attrs["window_starts"] = starts
    return frame


def _site_label(module: str, function: str, call: int) -> str:
    name = module or "(model)"
    return name if int(call) == 0 else f"{name} ({function} #{int(call)})"
