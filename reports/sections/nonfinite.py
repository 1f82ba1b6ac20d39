"""nonfinite: where NaN/Inf was born. A forward birth shows the max |output| of the module that
produced it and of its neighbours; a backward or optimizer birth, the gradient norms; a birth in
the batch or the loss, the loss."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...analyzer.detectors import nonfinite
from ...analyzer.errors import TraceError
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, first_nonfinite, no_figure, rows_between, undrawn
from ..model import Figure, Text
from ._text import name, names, step, text

KIND = "nonfinite"
# Modules drawn beside the one that produced the NaN: its nearest neighbours in definition order.
NEIGHBOURS = 8
# The figure shows what led to the NaN: this many of the recorder's checks before it (module
# outputs are checked on watched steps, every activations_every; gradients and loss every step,
# of which STEPS_BEFORE), and a few steps after.
CHECKS_BEFORE, STEPS_BEFORE = 8, 40


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: nonfinite.Evidence = f.evidence
    stage = ev.get("stage")
    at = step(f.step)
    if stage == "forward" and f.where:
        return text(f"NaN/Inf appeared at {at} in the forward pass of ", name(f.where[0]))
    if stage == "batch":
        return text(f"the input batch of {at} held NaN/Inf")
    if stage == "loss":
        return text(f"the loss went NaN/Inf at {at} while every module output was finite")
    if stage == "loss_backward":
        return text(f"the gradient the loss sent back to the model went NaN/Inf at {at}: born in the loss's backward")
    if stage == "unchecked":
        return text(f"the loss went NaN/Inf at {at}, a step whose module outputs were not checked")
    if stage == "backward" and f.where:
        return text("the gradient of ", name(f.where[0]), f" went NaN/Inf at {at} in the backward pass")
    if stage == "optimizer":
        return text("weights (", names(f.where), f") went NaN/Inf in the optimizer update of {at}")
    return text(f"NaN/Inf appeared at {at}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    fig = _figure_for(ctx, f)
    box = _blackbox_note(ctx.rank(f.rank), f)
    return replace(fig, caption=fig.caption + box) if box else fig


def _blackbox_note(rt, f: Finding) -> str:
    """Where the trace's black box can take the reader: the bad step, re-run on their machine."""
    try:
        bb = rt.blackbox
    except TraceError:
        return ""
    if not len(bb):
        return ""
    row = bb.iloc[0]
    at = int(row["step"])
    when = "before its bad update" if row["params_at"] == "start_of_step" else "after its update"
    rank = f" --rank {rt.rank}" if f.rank is not None else ""
    return (f" The trace's black box holds the parameters of step {at:,} {when} and that step's inputs: "
            f"torchautopsy export RUN_DIR{rank} --params blackbox params.safetensors --tensors blackbox "
            "inputs.safetensors, then load_state_dict and run the forward to see it again.")


def _figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    ev: nonfinite.Evidence = f.evidence
    stage = ev.get("stage")
    forward = stage == "forward" and f.where and f.where[0] in rt.module_names
    config = rt.meta.get("config") if isinstance(rt.meta.get("config"), dict) else {}
    every = config.get("activations_every", 10)
    span, note = _before(ctx, rt, f.step, CHECKS_BEFORE * every if forward and isinstance(every, int) and
                         0 < every < 10**6 else STEPS_BEFORE)
    if forward:
        return _forward(ctx, f, rt, span, note)
    if stage in ("backward", "loss_backward", "optimizer"):
        return _gradients(ctx, f, rt, span, note)
    title = ctx.title_rank("Loss around the first NaN/Inf", f.rank)
    loss = rt.columns["loss"]
    if not np.isfinite(loss.to_numpy()).any():
        return no_figure(title, "No finite loss was recorded.")
    caption = (f"Loss per step; the dotted line marks {step(f.step)}, where NaN/Inf first appeared "
               f"({stage or 'unknown stage'}). The line stops where the loss went NaN/Inf.{note}")
    caption = caption.replace(" The line stops", " A red cross on the top edge marks it; the line stops")
    return figure(title, caption, plots.plot_loss, {"loss": rows_between(loss.to_frame(), span)["loss"]},
                  marks=ctx.marks(only=f), xspan=span, nonfinite_at=[(float(f.step), "loss")])


def _before(ctx: Context, rt, at: int | None, before: int) -> tuple[tuple[float, float] | None, str]:
    """The steps the figure shows: ``before`` steps up to the NaN's step and a few after."""
    full = ctx.span(rt)
    if full is None or at is None:
        return full, ""
    lo = max(full[0], at - before)
    hi = min(full[1], at + max(2, (at - lo) // 8))
    if (lo, hi) == tuple(full):
        return full, ""
    return (lo, hi), f" Steps {int(lo):,}-{int(hi):,}: those that led to it; the overview shows the whole run."


def _forward(ctx, f, rt, span, note) -> Figure:
    title = ctx.title_rank("Module outputs around the first NaN/Inf", f.rank)
    out = ctx.module(rt, span)
    origin = rt.module_names.index(f.where[0])
    leaves = [j for j in range(len(rt.module_names)) if rt.module_is_leaf[j] and j != origin]
    near = sorted(leaves, key=lambda j: (abs(j - origin), j))[:NEIGHBOURS]
    cols = [rt.module_labels[j] for j in sorted(near + [origin])]
    frame = rows_between(out[cols], span)
    lines = [plots.Line(c, frame.index.to_numpy(), frame[c].to_numpy(), emphasis=c == rt.module_labels[origin])
             for c in cols]
    crosses = first_nonfinite(frame, cols)
    caption = (f"Largest |output| of {name_text(f.where[0])}, where NaN/Inf was born (thick), and of "
               f"the {len(near)} leaf modules defined nearest to it, on the steps the recorder checked them "
               f"(the steps it watched, and the bad step), log scale. Red crosses on the top edge mark each module's first non-finite output; the lines stop there. The "
               f"dotted line marks {step(f.step)}.{note}")
    return figure(title, caption, plots.plot_lines, lines, log=True, ylabel="max |output|",
                  marks=ctx.marks(only=f), xspan=span, nonfinite_at=crosses)


def _gradients(ctx, f, rt, span, note) -> Figure:
    title = ctx.title_rank("Gradient norms around the first NaN/Inf", f.rank)
    g = ctx.param(rt, "grad_norm", span)
    bad = ctx.param(rt, "grad_nonfinite", span)
    if g is None or bad is None:
        return no_figure(title, "No gradient statistics were recorded.")
    cols = list(dict.fromkeys([w for w in f.where if w in g.columns] + ctx.weights(rt)))
    frame = rows_between(g[cols], span)
    drawn = plots.largest_columns(frame, plots.MAX_LINES, keep=f.where)
    lines = [plots.Line(c, frame.index.to_numpy(), frame[c].to_numpy(), emphasis=c in f.where) for c in drawn]
    shown = list(dict.fromkeys(drawn + [w for w in f.where if w in bad.columns]))
    b = rows_between(bad[shown], span)
    crosses = first_nonfinite(b.where(b <= 0, np.nan), shown)
    caption = (f"Gradient L2 norm per weight tensor, per step, log scale; thick: the parameters the "
               f"finding names. Red crosses mark each parameter's first gradient holding NaN/Inf. The "
               f"dotted line marks {step(f.step)}.{note}{undrawn(f.where, drawn)}")
    return figure(title, caption, plots.plot_lines, lines, log=True, ylabel="gradient L2 norm",
                  marks=ctx.marks(only=f), xspan=span, nonfinite_at=crosses)


def name_text(n: str) -> str:
    return n or "the model itself"
