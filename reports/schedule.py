"""The overview's schedule figure: the learning rate of each param group over the steps, and
AMP's loss scale with the steps the GradScaler skipped, beside the loss and gradient norms."""

from __future__ import annotations

import numpy as np

from . import plots
from .context import Context, figure, no_figure, read_or_none
from .model import Figure

MAX_GROUPS = 6  # param groups drawn beside the first (distinct schedules only)


def _group_lrs(rt, steps: np.ndarray) -> dict[str, np.ndarray]:
    """The lr of each param group whose schedule differs from the first's, forward-filled from
    the change log (hyperparams/) onto every step."""
    hp = read_or_none(lambda: rt.hyperparams)
    if hp is None or not len(hp):
        return {}
    lr = hp[hp["name"] == "lr"]
    out = {}
    for (opt, group), rows in lr.groupby(["optimizer", "group"], sort=True):
        if (opt, group) == (0, 0):
            continue
        at = np.searchsorted(rows["step"].to_numpy(), steps, side="right") - 1
        values = np.where(at >= 0, rows["value"].to_numpy()[np.maximum(at, 0)], np.nan)
        label = f"group {group}" if opt == 0 else f"optimizer {opt} group {group}"
        if not any(np.array_equal(values, v, equal_nan=True) for v in out.values()):
            out[label] = values
        if len(out) >= MAX_GROUPS:
            break
    return out


def learning_rate(ctx: Context) -> Figure:
    rt = ctx.focus
    title = ctx.title_rank("Learning rate", rt.rank)
    steps = rt.step_index
    lr = rt.columns["lr"].to_numpy(dtype=np.float64)
    if not np.isfinite(lr).any():
        return no_figure(title, "No learning rate was recorded (no optimizer step of the model was seen, "
                                "or the trace predates it).")
    lines = [plots.Line("lr" if not rt.hyperparams["group"].gt(0).any() else "group 0", steps, lr,
                        color="#37474f", width=1.6)]
    lines += [plots.Line(k, steps, v, width=1.0) for k, v in _group_lrs(rt, steps).items()]
    finite = np.concatenate([ln.y[np.isfinite(ln.y) & (ln.y > 0)] for ln in lines])
    log = finite.size > 0 and finite.max() / finite.min() > 100
    caption = ("The learning rate each step's update used (the first optimizer's param groups; groups "
               "with the same schedule are drawn once)" + (", log scale." if log else "."))
    if ctx.marks(rt.rank):
        caption += " Dotted vertical lines mark the findings' steps: does one begin where the schedule turns?"
    return figure(title, caption, plots.plot_lines, lines, log=log, ylabel="learning rate",
                  marks=ctx.marks(rt.rank, labels=False), xspan=ctx.span(rt), height_in=2.4)


def loss_scale(ctx: Context) -> Figure | None:
    """AMP's loss scale, or None for a run without a GradScaler (nothing to show)."""
    rt = ctx.focus
    scale = rt.columns["loss_scale"].to_numpy(dtype=np.float64)
    if not np.isfinite(scale).any():
        return None
    steps = rt.step_index
    skipped = rt.amp_skipped
    title = ctx.title_rank("AMP loss scale", rt.rank)
    caption = (f"torch.amp.GradScaler's scale after each step (log scale); x: the {int(skipped.sum()):,} "
               f"steps it skipped because the scaled gradients overflowed (their updates were not applied).")
    return figure(title, caption, plots.plot_lines, [plots.Line("loss scale", steps, scale, color="#37474f")],
                  log=True, ylabel="loss scale", marks=ctx.marks(rt.rank, labels=False), xspan=ctx.span(rt),
                  nonfinite_at=[(float(s), "skipped") for s in steps[skipped][:2000]],
                  nonfinite_label="step skipped", height_in=2.4)
