"""The step-time figure that slow_steps and dataloader_bottleneck share: where each step's time
went (waiting for data, forward, backward and optimizer, the recorder), stacked."""

from __future__ import annotations

import numpy as np

from ...analyzer.trace.phases import TIMED, TIMED_NAMES
from ...analyzer.trace import RankTrace
from .. import plots
from ..context import Context, figure, no_figure, read_or_none
from ..model import Figure

COLORS = ("#ef6c00", "#1f77b4", "#2ca02c", "#9e9e9e")  # the first phase (data loading) stands out


def phase_list() -> str:
    """The phases, in words, as the legend names them."""
    names = [TIMED_NAMES[p] for p in TIMED]
    return ", ".join(names[:-1]) + " and " + names[-1]


def timed(rt: RankTrace) -> bool:
    return bool(np.isfinite(rt.columns["forward_s"].to_numpy(dtype=float)).any())


def _split(rt: RankTrace) -> bool:
    """Whether the time between steps splits into the DataLoader's wait and the rest."""
    return bool(np.isfinite(rt.columns["data_wait_s"].to_numpy(dtype=float)).any())


def _layers(rt: RankTrace, split: bool):
    """Yield (label, ms per step) of each stacked layer, one column read at a time: a long run is
    bucketed column by column, never held whole."""
    def ms(name):
        return np.nan_to_num(rt.columns[name].to_numpy(dtype=np.float64), nan=0.0) * 1e3

    for p in TIMED:
        if p == "between_steps_s" and split:
            between = ms(p)
            waited = np.clip(ms("data_wait_s"), 0.0, between)
            yield "waiting for the DataLoader", waited
            yield "other work between steps (idle)", between - waited
        else:
            yield TIMED_NAMES[p], ms(p)


def step_time_figure(ctx: Context, rt: RankTrace, title: str, caption: str, *, hlines=(), points=None,
                     points_label: str = "", marks=(), ymax: float | None = None) -> Figure:
    if rt.n_steps == 0 or not timed(rt):
        return no_figure(title, "Step phases were not timed in this trace (recorded by torchautopsy "
                                "0.1.0 or later).")
    split = _split(rt)
    colors = (("#ef6c00", "#ffcc80") + COLORS[1:]) if split else COLORS
    if split:
        caption += (" The time between steps is split into waiting for the DataLoader's next batch and the "
                    "rest of the loop's own work (or idle).")
    windows = read_or_none(lambda: rt.profile_windows)
    bands = [] if windows is None else [(int(w.step_start), int(w.step_end)) for w in windows.itertuples()]
    if bands:
        caption += (" Grey bands: the recorder's torch.profiler windows (" + ", ".join(
            f"steps {a:,}-{b:,}" if a != b else f"step {a:,}" for a, b in bands[:4]) + (", ..." if len(bands) > 4 else "")
            + "); the profiler slows the operators of the steps it records, so their forward and backward "
            "there are partly the recorder's cost, not the job's.")
    x = rt.step_index
    n = len(x)
    peak = None
    if n > plots.MAX_POINTS:  # bucket each column as it is read: means per bucket, and the slowest step
        starts = plots.bucket_edges(n, plots.MAX_POINTS // 2)[:-1]
        counts = np.diff(np.append(starts, n))
        total = np.zeros(n)
        layers = {}
        for label, v in _layers(rt, split):
            total += v
            layers[label] = np.add.reduceat(v, starts) / counts
        peak = np.maximum.reduceat(total, starts)
        x = x[starts]
    else:
        layers = dict(_layers(rt, split))
    return figure(title, caption, plots.plot_stacked, x, layers, ylabel="ms per step", colors=colors,
                  hlines=hlines, points=points, points_label=points_label, marks=marks,
                  xspan=ctx.span(rt), ymax=ymax, peak=peak, bands=bands,
                  bands_label="the recorder's profiler window")
