"""input_data: the batch's statistics as the model received it, step by step (min, max, mean
and mean +- std), with the finding's step marked."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import input_data
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import step, text

KIND = "input_data"
WHAT = {"unnormalized": "the inputs were never normalised", "feature_scales": "the input features' scales differ wildly",
        "constant_batch": "a constant (blank) batch", "shift": "the inputs shifted",
        "constant_features": "some input features never vary"}


def phrase(fs: list[Finding]) -> Text:
    ev: input_data.Evidence = fs[0].evidence
    return text(WHAT.get(ev.get("cause"), "the inputs look wrong"),
                f" at {step(fs[0].step)}" if ev.get("cause") in ("constant_batch", "shift") else "")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("The batch as the model received it", f.rank)
    c = rt.columns
    x = rt.step_index.astype(float)
    mean, std = c["input_mean"].to_numpy(np.float64), c["input_std"].to_numpy(np.float64)
    if not np.isfinite(mean).any():
        return no_figure(title, "No statistics of the batch were recorded (no floating-point input).")
    lines = [plots.Line("max", x, c["input_max"].to_numpy(np.float64), color="#9e9e9e"),
             plots.Line("min", x, c["input_min"].to_numpy(np.float64), color="#9e9e9e", style="--"),
             plots.Line("mean + std", x, mean + std, color="#1565c0", style=":"),
             plots.Line("mean - std", x, mean - std, color="#1565c0", style=":"),
             plots.Line("mean", x, mean, emphasis=True)]
    caption = ("Each step's batch (its first floating-point input, over its first samples): the smallest and largest "
               "value, and the mean +- one standard deviation. Normalised inputs sit around 0 with a std near 1.")
    return figure(title, caption, plots.plot_lines, lines, ylabel="input value", marks=ctx.marks(rt.rank, kind=KIND),
                  xspan=ctx.span(rt))
