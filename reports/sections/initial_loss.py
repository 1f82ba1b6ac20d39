"""initial_loss: the loss from its first step, against the loss of chance (ln of the classes)."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import initial_loss
from ...analyzer.trace.losses import loss_series
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import num, text

KIND = "initial_loss"


def phrase(fs: list[Finding]) -> Text:
    ev: initial_loss.Evidence = fs[0].evidence
    if ev.get("cause") == "never_moved":
        return text("the loss never moved")
    return text(f"the loss started at {num(ev.get('initial_loss'), '.3g')}, far above chance "
                f"({num(ev.get('chance_loss'), '.3g')})")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("The loss from its first step", f.rank)
    loss, _ = loss_series(rt)
    if not np.isfinite(loss).any():
        return no_figure(title, "No loss was recorded.")
    ev: initial_loss.Evidence = f.evidence
    hlines = []
    if ev.get("chance_loss") is not None:
        hlines.append((float(ev["chance_loss"]), f"chance: ln {ev.get('classes')} = {ev['chance_loss']:.3g}",
                       "#2e7d32", "--"))
    caption = ("The loss of each step. A classifier that has not trained predicts about uniformly over its classes: "
               "its cross-entropy starts near ln(classes), the dashed line.") if hlines else \
        "The loss of each step: it never left where it started."
    return figure(title, caption, plots.plot_lines, [plots.Line("loss", rt.step_index.astype(float), loss,
                                                                emphasis=True)],
                  ylabel="loss", hlines=hlines, marks=ctx.marks(rt.rank, kind=KIND), xspan=ctx.span(rt))
