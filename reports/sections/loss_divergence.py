"""loss_divergence: the loss, its trailing median and the best value so far."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ...analyzer.detectors import loss_divergence
from ...analyzer.findings import Finding
from ...analyzer.series import trailing_median
from .. import plots
from ..context import Context, figure, no_figure, rows_between
from ..model import Figure, Text
from ._text import num, step, text

KIND = "loss_divergence"


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: loss_divergence.Evidence = f.evidence
    tail = (f", then went NaN/Inf at {step(ev['first_nonfinite_loss_step'])}"
            if ev.get("first_nonfinite_loss_step") is not None else "")
    return text(f"the loss diverged from {step(f.step)} ({num(ev.get('loss_at_step'), '.4g')} against a "
                f"best of {num(ev.get('best_smoothed_loss'), '.4g')}){tail}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Loss", f.rank)
    loss = rt.columns["loss"]
    if not np.isfinite(loss.to_numpy()).any():
        return no_figure(title, "No finite loss was recorded.")
    ev: loss_divergence.Evidence = f.evidence
    window = int(ev.get("window_steps") or ctx.cfg.loss_divergence.window)
    y = loss.to_numpy(dtype=np.float64)
    med = trailing_median(np.where(np.isfinite(y), y, np.nan), window)
    med[: window - 1] = np.nan
    med[~np.isfinite(y)] = np.nan  # a median over the finite losses left would hide the blow-up
    best = np.fmin.accumulate(np.where(np.isnan(med), np.inf, med))
    best[~np.isfinite(best)] = np.nan
    bad = ev.get("first_nonfinite_loss_step")
    if bad is not None:  # the best so far ends where the loss did: nothing was learnt after a NaN
        best[loss.index.to_numpy() >= bad] = np.nan
    span, note = ctx.window(rt, f.step)
    idx = loss.index
    smoothed = rows_between(pd.DataFrame({"m": med, "b": best}, index=idx), span)
    x = smoothed.index.to_numpy()
    extra = [plots.Line("best so far", x, smoothed["b"].to_numpy(), color="#2e7d32", style="--", width=1.2)]
    caption = (f"Loss per step (grey), its trailing median over {window} steps (thick) and the lowest "
               f"median so far (green dashed). The dotted line marks {step(f.step)}, where the loss "
               f"rose far above its best and stayed up")
    caption += (f"; it went NaN/Inf at {step(bad)}, where the lines stop." if bad is not None else ".") + note
    return figure(title, caption, plots.plot_loss, {"loss": rows_between(loss.to_frame(), span)["loss"]},
                  smoothed={f"median of {window}": smoothed["m"]}, extra=extra,
                  marks=ctx.marks(only=f), xspan=span)
