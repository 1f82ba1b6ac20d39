"""train_eval_mode: the model's mode at each step's training forward passes (1 train, 0 eval),
and the forward passes without gradients that ran in train mode."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import train_eval_mode
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import names, step, text

KIND = "train_eval_mode"


def phrase(fs: list[Finding]) -> Text:
    ev: train_eval_mode.Evidence = fs[0].evidence
    if ev.get("cause") == "evaluated_in_train":
        return text("an evaluation ran in train mode at ", step(fs[0].step))
    return text("the model trained in eval mode from ", step(fs[0].step), " (", names(fs[0].where, 2), ")")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("The model's mode at each step", f.rank)
    mode = rt.columns["train_mode"].to_numpy().astype(float)
    nograd = rt.columns["nograd_train_forwards"].to_numpy().astype(float)
    x = rt.step_index.astype(float)
    if not (mode >= 0).any():
        return no_figure(title, "The model's mode was not recorded (a compiled forward, or an older trace).")
    shown = np.where(mode == 2, 0.5, np.where(mode >= 0, mode, np.nan))  # (both modes in one step: halfway)
    lines = [plots.Line("mode of the training forward passes (1 train, 0 eval)", x, shown, emphasis=True,
                        marker="." if len(x) < 200 else None)]
    if (nograd > 0).any():
        lines.append(plots.Line("forward passes without gradients in train mode", x[nograd > 0],
                                np.ones(int((nograd > 0).sum())) * 1.05, style="none", marker="v", color="#c62828"))
    caption = ("1: the step's forward passes with gradients ran with model.training True; 0: False (eval mode: "
               "no dropout, BatchNorm's running statistics used and frozen); 0.5: both. Red triangles: steps "
               "with forward passes without gradients (an evaluation) in train mode.")
    return figure(title, caption, plots.plot_lines, lines, ylabel="model.training", ylim=(-0.1, 1.15),
                  marks=ctx.marks(rt.rank, kind=KIND), xspan=ctx.span(rt))
