"""loss_plateau: the loss, smoothed, with the band it stayed in since the plateau began."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...analyzer.detectors import loss_plateau
from ...analyzer.findings import Finding
from ...analyzer.series import trailing_median
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import num, step, text

KIND = "loss_plateau"


def phrase(fs: list[Finding]) -> Text:
    ev: loss_plateau.Evidence = fs[0].evidence
    return text(f"the loss plateaued at {num(ev.get('loss_level'), '.4g')} from {step(fs[0].step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Loss plateau", f.rank)
    loss = rt.columns["loss"]
    y = loss.to_numpy(dtype=np.float64)
    if not np.isfinite(y).any():
        return no_figure(title, "No finite loss was recorded.")
    cfg = ctx.cfg.loss_plateau
    w = max(2, min(50, len(y) // 20))
    med = pd.Series(trailing_median(np.where(np.isfinite(y), y, np.nan), w), index=loss.index)
    med.iloc[: w - 1] = np.nan
    ev: loss_plateau.Evidence = f.evidence
    level, start = ev.get("loss_level"), ev.get("plateau_start_step", f.step)
    spans, hlines = [], []
    if isinstance(level, (int, float)) and start is not None:
        band = abs(level) * cfg.min_improvement
        spans = [(float(start), float(loss.index[-1]), level - band, level + band,
                  f"±{cfg.min_improvement:.0%} of the plateau level")]
        hlines = [(float(level), f"plateau level {level:.4g}", "#ef6c00", "--")]
    caption = (f"Loss per step (grey) and its trailing median over {w} steps (thick). The shaded band "
               f"is the plateau level ±{cfg.min_improvement:.0%}, from {step(start)}: the loss no "
               f"longer left it.")
    return figure(title, caption, plots.plot_loss, {"loss": loss}, smoothed={f"median of {w}": med},
                  spans=spans, hlines=hlines, marks=ctx.marks(only=f), xspan=ctx.span(rt))
