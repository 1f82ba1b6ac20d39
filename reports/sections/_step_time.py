"""The step-time figure that slow_steps and dataloader_bottleneck share: where each step's time
went (waiting for data, forward, backward and optimizer, the recorder), stacked."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors._step_time import PHASE_NAMES, PHASES, phases
from ...analyzer.trace import RankTrace
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure

COLORS = ("#ef6c00", "#1f77b4", "#2ca02c", "#9e9e9e")  # the first phase (data loading) stands out


def phase_list() -> str:
    """The phases, in words, as the legend names them."""
    names = [PHASE_NAMES[p] for p in PHASES]
    return ", ".join(names[:-1]) + " and " + names[-1]


def timed(rt: RankTrace) -> bool:
    t, total = phases(rt)
    return bool(np.isfinite(total).any())


def step_time_figure(ctx: Context, rt: RankTrace, title: str, caption: str, *, hlines=(), points=None,
                     points_label: str = "", marks=(), ymax: float | None = None) -> Figure:
    if rt.n_steps == 0 or not timed(rt):
        return no_figure(title, "Step phases were not timed in this trace (recorded by torchautopsy "
                                "0.1.0 or later).")
    t, _ = phases(rt)
    x = rt.step_index
    layers = {PHASE_NAMES[p]: t[:, k] * 1e3 for k, p in enumerate(PHASES)}
    colors = COLORS
    # With a DataLoader, the time between steps splits into waiting for its next batch and the
    # rest of the loop (logging, checkpoints, idle): the two are told apart.
    wait = rt.steps["data_wait_s"].to_numpy(dtype=float)
    if np.isfinite(wait).any():
        between = t[:, 0] * 1e3
        waited = np.clip(np.nan_to_num(wait, nan=0.0) * 1e3, 0.0, np.nan_to_num(between, nan=0.0))
        rest = {k: v for k, v in list(layers.items())[1:]}
        layers = {"waiting for the DataLoader": waited, "other work between steps (idle)": between - waited, **rest}
        colors = ("#ef6c00", "#ffcc80") + COLORS[1:]
        caption += (" The time between steps is split into waiting for the DataLoader's next batch and the "
                    "rest of the loop's own work (or idle).")
    return figure(title, caption, plots.plot_stacked, x, layers, ylabel="ms per step", colors=colors,
                  hlines=hlines, points=points, points_label=points_label, marks=marks,
                  xspan=ctx.span(rt), ymax=ymax)
