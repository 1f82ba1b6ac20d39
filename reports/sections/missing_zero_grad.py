"""missing_zero_grad: the total gradient norm, step by step, growing as a sum does; the steps
whose optimizer step reused the previous step's gradient tensors are marked."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import missing_zero_grad
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import num, step, text

KIND = "missing_zero_grad"


def phrase(fs: list[Finding]) -> Text:
    ev: missing_zero_grad.Evidence = fs[0].evidence
    return text(f"the gradients were never cleared (no zero_grad()): summed from {step(fs[0].step)} on, "
                f"their norm grew {num(ev.get('growth'), '.3g')}x")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Total gradient norm, never cleared", f.rank)
    norm = np.asarray(rt.digest.total_grad_norm, dtype=float)
    kept = rt.columns["grads_kept"].to_numpy()
    x = rt.step_index.astype(float)
    if not np.isfinite(norm).any():
        return no_figure(title, "No gradient norm was recorded.")
    lines = [plots.Line("total gradient norm", x, norm, emphasis=True),
             plots.Line("reused the previous step's gradients", x[kept == 1], norm[kept == 1], style="none",
                        marker="o", color="#c62828", emphasis=True)]
    caption = ("The L2 norm of all gradients at each optimizer step. Red dots: steps whose optimizer step used "
               "the very gradient tensors of the step before (no zero_grad() between them). A gradient that is "
               "never cleared is the sum of every batch's: its norm grows step over step, like t.")
    return figure(title, caption, plots.plot_lines, lines, ylabel="||g||", marks=ctx.marks(rt.rank, kind=KIND),
                  xspan=ctx.span(rt))
