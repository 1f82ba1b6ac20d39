"""The overview: the whole run at a glance. Loss, gradient norm per layer x step, update ratios,
memory, and a timeline of the findings. Long runs are bucketed (max, or min and max, per bucket)
so that a million steps draw as fast as a thousand and no spike is lost."""

from __future__ import annotations

import warnings

import numpy as np

from ..analyzer.restarts import rerun_losses, restart_marks
from . import layer_plots, plots, schedule
from .context import Context, figure, no_figure, read_or_none
from .model import Figure

# The heatmap: at most this many rows (more layers are merged, max per group) and step columns.
HEATMAP_ROWS = 48
HEATMAP_COLS = 400
# The timeline: at most this many findings (the most severe first, as the report lists them).
TIMELINE_ROWS = 30
MIB = 2**20
MAX_RANK_LINES = 6  # a line per rank up to this many ranks; more: the median rank and the odd ones

# name -> builder; the overview shows them in this order.
FIGURES = ("loss", "learning_rate", "loss_scale", "grad_heatmap", "update_ratios", "memory", "step_time", "timeline")


def build(ctx: Context, name: str) -> Figure | None:
    """The overview's figure `name`; None where it has nothing to show (no GradScaler)."""
    if name in ("learning_rate", "loss_scale"):
        return getattr(schedule, name)(ctx)
    return globals()[f"_{name}"](ctx)


def _loss(ctx: Context) -> Figure:
    title = "Loss"
    multi = len(ctx.trace.ranks) > 1
    if len(ctx.trace.ranks) > MAX_RANK_LINES:  # many ranks: the median rank's, and the ranks the findings name
        losses = _median_and_odd_loss(ctx)
    else:
        losses = {(f"rank {r}" if multi else "loss"): rt.columns["loss"] for r, rt in ctx.trace.ranks.items()}
    losses.update(rerun_losses(ctx.trace))  # a restarted job: the steps a later attempt ran again
    if not any(np.isfinite(s.to_numpy()).any() for s in losses.values()):
        return no_figure(title, "No finite loss was recorded (was rec.step() called with loss=?).")
    caption = ("Loss per step (log scale when it spans more than two orders of magnitude). Dotted "
               "vertical lines mark the first step of each finding (see the timeline); gaps are steps "
               "whose loss was NaN or Inf.")
    restarts = restart_marks(ctx.trace)
    if restarts:
        caption += (" Grey dotted lines: restarts (the attempt resumed at that step; each attempt is a file, see "
                    "the header); 'steps run again': an earlier attempt's loss over steps a later one re-ran.")
    return figure(title, caption, plots.plot_loss, losses, marks=ctx.marks() + restarts)


def _grad_heatmap(ctx: Context) -> Figure:
    rt = ctx.focus
    title = ctx.title_rank("Gradient norm per layer and step", rt.rank)
    names = ctx.weights(rt)
    if rt.n_steps == 0 or not names:
        return no_figure(title, "No gradient norms were recorded.")
    cols = [rt.param_names.index(n) for n in names]
    # Step buckets (columns), max per bucket, read a block of steps at a time: an explosion of
    # one step stays visible, and a million steps never sit in memory at once.
    steps = rt.step_index
    edges = plots.bucket_edges(len(steps), HEATMAP_COLS)
    g = read_or_none(lambda: rt.bucketed("params/grad_norm", edges, cols))
    if g is None:
        return no_figure(title, "No gradient norms were recorded.")
    bad = read_or_none(lambda: rt.bucketed("params/grad_nonfinite", edges, cols))
    vb = g["positive_max"]
    # NaN/Inf: counted as such by the recorder, or an Inf norm (an overflow of finite values).
    nb = g["inf"] | ((bad["max"] > 0) if bad is not None else g["nonfinite"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # Layer groups (rows), when there are too many to show one each.
        row_edges = plots.bucket_edges(len(names), HEATMAP_ROWS)
        # A cell is exactly 0 when every finite norm in it is 0 (and none is NaN/Inf).
        zb = np.fmax.reduceat(g["max"], row_edges[:-1], axis=1) == 0
        vb = np.fmax.reduceat(vb, row_edges[:-1], axis=1)
        nb = np.logical_or.reduceat(nb, row_edges[:-1], axis=1)
        zb &= ~nb
    labels = [names[a] if b - a == 1 else f"{names[a]} (+{b - a - 1})" for a, b in zip(row_edges[:-1], row_edges[1:])]
    x_edges = np.append(steps[edges[:-1]], steps[-1] + 1).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        logv = np.log10(vb)
    kind = "weight matrices and kernels" if len(names) < len(rt.param_names) or all(
        len(s) >= 2 for s in rt.param_shapes) else "parameters"
    caption = (f"log10 of the gradient L2 norm of each of the {len(names):,} {kind} (rows, in "
               f"definition order: input side at the top) at each step (columns). Red: NaN/Inf; black: "
               f"exactly zero; light grey: no gradient (the parameter took no part in the backward).")
    if ctx.marks(rt.rank):
        caption += " Dotted vertical lines mark the findings' steps."
    if len(edges) - 1 < len(steps):
        caption += f" Each column is the largest norm over {len(steps) / (len(edges) - 1):.0f} steps."
    if len(row_edges) - 1 < len(names):
        caption += " Each row is the largest norm over a group of consecutive tensors, named by its first."
    n_rows = len(labels)
    height = float(np.clip(1.1 + 0.14 * n_rows, 2.4, 7.5))
    return figure(title, caption, layer_plots.plot_heatmap, logv.T, labels, x_edges, nonfinite=nb.T, zero=zb.T,
                  empty_label="no gradient", cbar_label="log10 gradient L2 norm", marks=ctx.marks(rt.rank, labels=False), height_in=height)


def _update_ratios(ctx: Context) -> Figure:
    rt = ctx.focus
    title = ctx.title_rank("Update-to-weight ratios", rt.rank)
    upd = ctx.updates(rt)
    min_ndim = ctx.cfg.update_ratio.min_ndim
    cols = [n for n, s in zip(rt.param_names, rt.param_shapes) if len(s) >= min_ndim]
    if upd is None or upd.empty or not cols:
        return no_figure(title, "No update ratios were recorded (Recorder option update_ratio_every).")
    u = upd[cols].to_numpy(dtype=np.float64)
    u = np.where(np.isfinite(u) & (u > 0), u, np.nan)
    x = upd.index.to_numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, mid, hi = np.nanmin(u, axis=1), np.nanmedian(u, axis=1), np.nanmax(u, axis=1)
    named = [w for f in ctx.findings if f.kind == "update_ratio" and f.rank in (None, rt.rank)
             for w in f.where if w in upd.columns][:6]
    lines = [plots.Line("largest", x, hi, color="#ef9a9a", width=1.0),
             plots.Line("median", x, mid, color="#37474f", width=1.8),
             plots.Line("smallest", x, lo, color="#90caf9", width=1.0)]
    lines += [plots.Line(n, x, upd[n].to_numpy(dtype=float), emphasis=True) for n in named]
    cfg = ctx.cfg.update_ratio
    hlines = [(1e-3, "usual ~1e-3", "#2e7d32", "--"), (cfg.too_large, f"too large ({cfg.too_large:g})", "#c62828", "--"),
              (cfg.too_small, f"too small ({cfg.too_small:g})", "#c62828", "--")]
    caption = (f"||Δw|| / ||w|| of one optimizer step, at each sampled step: the median, largest and "
               f"smallest over the {len(cols):,} weight tensors of {min_ndim}+ dimensions (log scale)")
    caption += ("; thick: the tensors an update_ratio finding names." if named else ".")
    if upd.attrs.get("envelope"):
        caption += " A long run: each bucket of samples is drawn as its largest and its smallest value."
    caption += _why_ratios_stop(ctx, rt, x, np.isfinite(mid))
    caption += " Dotted vertical lines mark the findings' steps (see the timeline)." if ctx.marks(rt.rank) else ""
    return figure(title, caption, plots.plot_lines, lines, log=True, ylabel="update / weight",
                  hlines=hlines, marks=ctx.marks(rt.rank, labels=False), xspan=ctx.span(rt))


def _why_ratios_stop(ctx: Context, rt, x: np.ndarray, finite: np.ndarray) -> str:
    """A sentence when the lines stop well before the run does: the weights or gradients went
    NaN/Inf (no ratio means anything then), or the samples simply ended."""
    span = ctx.span(rt)
    if not finite.any() or span is None or len(x) < 2:
        return ""
    last = int(x[finite][-1])
    interval = float(np.median(np.diff(x)))
    if span[1] - last <= 2 * interval:
        return ""
    d = rt.digest
    bad = np.flatnonzero(d.grad_nonfinite | d.param_nonfinite)
    if bad.size and int(rt.step_index[bad[0]]) <= last + 2 * interval:
        return (f" The lines stop at step {last:,}: from step {int(rt.step_index[bad[0]]):,} the gradients or "
                f"weights held NaN/Inf, and a ratio of those means nothing.")
    return f" The last sample is at step {last:,} (samples are taken within a time budget: Recorder option update_ratio_every)."


def _memory(ctx: Context) -> Figure:
    title = "Memory"
    series = {}
    multi = len(ctx.trace.ranks) > 1
    many = len(ctx.trace.ranks) > MAX_RANK_LINES
    for col, label in (("rss_bytes", "resident (RSS)"), ("cuda_allocated_bytes", "CUDA allocated"),
                       ("cuda_reserved_bytes", "CUDA reserved")):
        if many:  # the median rank's, the largest, and the ranks the findings name: from their buckets
            series.update(_many_memory(ctx, col.removesuffix("_bytes"), f" {label}"))
            continue
        by_rank = {}
        for r, rt in ctx.trace.ranks.items():
            y = rt.columns[col]
            if (y.to_numpy() >= 0).any():
                by_rank[r] = y.where(y >= 0) / MIB
        for r, y in by_rank.items():
            series[f"rank {r} {label}" if multi else label] = (y.index.to_numpy(), y.to_numpy(dtype=float))
    if not series:
        return no_figure(title, "No memory was recorded.")
    caption = ("Memory per step, in MiB: the process's resident memory and, on a GPU, the CUDA "
               "allocator's allocated and reserved bytes.")
    live = ctx.focus.columns["live_tensors"]
    own = live.index.to_numpy()[live.to_numpy() >= 0]
    if own.size:
        caption += (" Grey ticks on the bottom edge: the steps the recorder took its census of live tensors; "
                    "its own work there can raise resident memory by a few MiB, which the process may keep.")
    if ctx.marks():
        caption += " Dotted vertical lines mark the findings' steps (see the timeline)."
    return figure(title, caption, plots.plot_memory, series, marks=ctx.marks(labels=False), own_steps=own)


def _many_memory(ctx: Context, name: str, label: str) -> dict:
    """Many ranks' memory of one kind (MiB) as bucket_lines: the median rank's, the largest of any
    rank, the ranks the findings name; {} where no rank measured it."""
    from .ranks import bucket_lines, digests

    ds = {r: d for r, d in digests(ctx).items() if r in ctx.trace.ranks}
    odd = list(dict.fromkeys(f.rank for f in ctx.findings if f.rank in ds and f.severity != "info"))
    lines = bucket_lines(ds, name, odd[:MAX_RANK_LINES - 2], largest=True, label=label)
    if not lines or not any(np.isfinite(y).any() for _, y in lines.values()):
        return {}
    return {k: (x, y / MIB) for k, (x, y) in lines.items()}


def _median_and_odd_loss(ctx: Context) -> dict:
    """_median_and_odd of the ranks' losses, from their bucketed digests (reports/ranks.py
    bucket_lines: the median of the ranks' bucket means, the odd ranks' means): reading every
    rank's loss column would keep 1,024 ranks' tables in memory (+250 MB at 10,000 steps, measured)."""
    import pandas as pd

    from .ranks import bucket_lines, digests

    ds = {r: d for r, d in digests(ctx).items() if r in ctx.trace.ranks}
    odd = list(dict.fromkeys(f.rank for f in ctx.findings if f.rank in ds and f.severity != "info"))
    lines = bucket_lines(ds, "loss", odd[:MAX_RANK_LINES - 2])
    return {name: pd.Series(y, index=pd.Index(x.astype(np.int64), name="step")) for name, (x, y) in lines.items()}


def _step_time(ctx: Context) -> Figure:
    from .sections._step_time import phase_list, step_time_figure

    rt = ctx.focus
    caption = (f"Time of each step (host clock) split into the phases the recorder times ({phase_list()}), "
               f"stacked, in ms.")
    return step_time_figure(ctx, rt, ctx.title_rank("Step time by phase", rt.rank), caption)


def _timeline(ctx: Context) -> Figure:
    title = "Timeline of the findings"
    dated = [f for f in ctx.findings if f.step is not None]
    if not dated:
        return no_figure(title, "No finding has a step to place on a timeline.")
    shown = sorted(dated[:TIMELINE_ROWS], key=lambda f: (f.step, f.rank or 0))
    multi = len(ctx.trace.ranks) > 1
    events = []
    for f in shown:
        where = f.where[0] if f.where else ""
        if f.where and not where:
            where = "(model)"
        label = f.kind + (f" · {where}" if where else "") + (f" · rank {f.rank}" if multi and f.rank is not None else "")
        events.append((label, int(f.step), f.severity, ctx.marker(f.kind)))
    ends = [e[1] for e in events] + [int(rt.step_index[i]) for rt in ctx.trace.ranks.values()
                                     if rt.n_steps for i in (0, -1)]
    lo, hi = min(ends), max(ends)
    caption = ("Each finding at the first step it shows, in order of time, over the whole run; "
               "colour: severity.")
    if len(dated) > len(shown):
        caption += f" {len(dated) - len(shown):,} more findings with a step are not drawn."
    height = float(np.clip(0.9 + 0.22 * len(events), 1.6, 7.5))
    return figure(title, caption, plots.plot_timeline, events, xspan=(float(lo), float(max(hi, lo + 1))),
                  height_in=height)
