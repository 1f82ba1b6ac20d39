"""Distributions: the recorded histograms over steps (one picture per layer group, weights,
gradients and activations side by side, findings marked), and one layer's weights at the
parameter snapshots before and after the first finding. Bounded: at most MAX_GROUPS pictures of
at most HIST_COLS step columns, one snapshot comparison. Traces without histograms or snapshots
add nothing (the appendix says what the trace holds)."""

from __future__ import annotations

import warnings

import numpy as np
from matplotlib.colors import ListedColormap

from ..analyzer.errors import TraceError
from ..analyzer.findings import Finding, first_to_go_wrong
from ..analyzer.trace import HIST_KINDS, RankTrace
from . import plots
from .context import Context, figure, no_figure
from .model import Figure

# Layer groups (early, middle, late layers): one picture each.
MAX_GROUPS = 3
# Histogram rows (sampled steps) a picture reads at most, evenly spread over the run, plus the
# rows at the findings' steps.
HIST_COLS = 200
_KIND_TITLES = {"weight": "weights", "grad": "gradients", "activation": "activations"}


def figures(ctx: Context) -> list[Figure]:
    rt = ctx.focus
    out: list[Figure] = []
    try:
        steps = rt.histogram_steps
        # At most HIST_COLS rows, evenly spread, and the rows nearest each finding's step: memory
        # bounded by the number of layers, whatever the length of the run.
        rows = set(np.linspace(0, len(steps) - 1, min(len(steps), HIST_COLS)).astype(int).tolist())
        for step, *_ in ctx.marks(rank=rt.rank):
            if len(steps):
                rows.add(int(np.clip(np.searchsorted(steps, step), 0, len(steps) - 1)))
        data = {k: rt.histograms(k, rows=sorted(rows)) for k in HIST_KINDS}
        lower, upper = rt.histogram_bins
    except TraceError:
        return []
    if not lower.size or not any(len(d[0]) for d in data.values()):
        return []
    if not any(len(d[0]) >= 2 for d in data.values()):
        # "Over steps" needs two steps at least (a short run: the default samples step 0 only).
        at = ", ".join(f"{int(x):,}" for x in steps[:5])
        return [no_figure(ctx.title_rank("Value distributions over steps", rt.rank),
                          f"Not drawn: the trace holds histograms of weights, gradients and activations at "
                          f"step {at} only, too few to show a change over steps (histogram_every and "
                          f"histogram_budget of the recorder set how often they are taken).")]
    n_groups = min(MAX_GROUPS, max(len(d[1]) for d in data.values()))
    labels = ("early", "middle", "late") if n_groups == 3 else ("early", "late") if n_groups == 2 else ("all",)
    for g in range(n_groups):
        panels, names = [], []
        for kind in HIST_KINDS:
            steps, tnames, counts = data[kind]
            if not len(steps) or not tnames:
                continue
            # Tensor i of n goes to the group its middle falls in: with fewer tensors than groups (a GRU
            # and its head), the last one still lands in the late layers.
            n = len(tnames)
            chunk = np.flatnonzero(((np.arange(n) + 0.5) * n_groups / n).astype(int) == g)
            if not chunk.size:
                continue
            names += [tnames[i] for i in chunk]
            c = np.where(counts[:, chunk, :] < 0, 0, counts[:, chunk, :]).sum(axis=1).astype(np.float64)
            panels.append((_KIND_TITLES[kind], steps, c))
        if not panels:
            continue
        shown = ", ".join(n or "(model)" for n in list(dict.fromkeys(names))[:6])
        more = len(dict.fromkeys(names)) - 6
        title = ctx.title_rank(f"Value distributions over steps: {labels[g]} layers", rt.rank)
        drawn = sorted({int(x) for _, st, _ in panels for x in st})
        if len(drawn) <= 8:
            cols = (f"the histograms at steps {', '.join(f'{x:,}' for x in drawn)}, each a narrow column at "
                    "the step it was taken (nothing was measured between them)")
        else:
            cols = (f"{len(drawn):,} sampled steps from {drawn[0]:,} to {drawn[-1]:,} (at most {HIST_COLS}, "
                    "evenly spread, and those at the findings)")
        seen = []  # "weights: NaN in the histograms from step 100 on", per panel and kind of non-finite value
        for ptitle, st, c in panels:
            for b, what in ((0, "NaN"), (lower.size - 1, "+Inf"), (1, "-Inf")):
                hit = np.flatnonzero(c[:, b] > 0)
                if hit.size:
                    seen.append(f"{ptitle}: {what} in the histograms from step {int(st[hit[0]]):,} on")
        nonfinite = bool(seen)
        marks = ctx.marks(rank=rt.rank)
        kinds = [t for t, _, _ in panels]
        kinds = ", ".join(kinds[:-1]) + " and " + kinds[-1] if len(kinds) > 1 else kinds[0]
        kinds = kinds.replace("activations", "activations (module outputs)")
        caption = (f"Histograms of the {labels[g]} layers' {kinds}, "
                   f"each summed over its tensors ({shown}{f' and {more} more' if more > 0 else ''}). Columns: {cols}; "
                   "colour: share of the elements in each bin (log scale). Rows: fixed bins of signed magnitude "
                   "(half octaves, the same at every step); exact zeros, +Inf (top), -Inf and NaN (bottom) have "
                   "taller rows of their own" +
                   (f"; red cells there mark non-finite values ({'; '.join(seen)})." if nonfinite
                    else " (empty here: no NaN or Inf).") +
                   (" Dotted lines mark the findings." if marks else ""))
        out.append(figure(title, caption, plot_histograms, panels, lower, upper, marks=marks,
                          end=int(rt.step_index[-1]) + 1 if rt.n_steps else None, height_in=3.2))
    return out


def snapshot_figures(ctx: Context) -> list[Figure]:
    snap = _snapshot_figure(ctx, ctx.focus)
    return [snap] if snap is not None else []


def _display_order(n_bins: int) -> np.ndarray:
    """Top to bottom: +Inf, positive magnitudes large to small, zero, negative small to large,
    -Inf, NaN (bin 0)."""
    return np.array(list(range(n_bins - 1, 0, -1)) + [0])


def _bin_label(lo: float, hi: float, i: int) -> str:
    if i == 0:
        return "NaN"
    if np.isinf(lo) and np.isinf(hi):
        return "+Inf" if lo > 0 else "-Inf"
    if lo < 0 < hi:
        return "0"
    v = lo if lo > 0 else hi
    return f"{v:+.0e}".replace("e+0", "e").replace("e-0", "e-")


def _at_their_steps(steps: np.ndarray, values: np.ndarray, bad: np.ndarray):
    """Columns [step, step + w) with empty (NaN) columns between them, w a third of the smallest
    interval between samples (at least one step when the samples allow it)."""
    w = max(min(1.0, float(np.diff(steps).min()) / 2), float(np.diff(steps).min()) / 3)
    x_edges = np.column_stack([steps, steps + w]).ravel()
    n_rows, n = values.shape
    spaced = np.full((n_rows, 2 * n - 1), np.nan)
    spaced[:, ::2] = values
    spaced_bad = np.zeros((n_rows, 2 * n - 1), dtype=bool)
    spaced_bad[:, ::2] = bad
    return x_edges, spaced, spaced_bad


def plot_histograms(panels, lower: np.ndarray, upper: np.ndarray, ax, *, marks=(), end: int | None = None) -> None:
    """Side-by-side heatmaps (bins x step buckets) of summed histogram counts, one per kind. Each
    sample is a narrow column at its step; when there are more samples than columns, a bucket of
    them holds from its first step to the next bucket's (the last, to ``end`` or one interval on)."""
    fig = ax.figure
    ax.remove()
    # The panels and, in a narrow column of the same grid, their colorbar: one row that
    # plots.render_png's margins move as a whole.
    outer = fig.add_gridspec(1, 2, width_ratios=[1, 0.018], wspace=0.02)
    axes = outer[0].subgridspec(1, len(panels)).subplots(sharey=True, squeeze=False)[0]
    colorbar_ax = fig.add_subplot(outer[1])
    order = _display_order(lower.size)
    # Only the range of magnitude bins that holds anything, plus the special bins.
    total = sum(c.sum(axis=0) for _, _, c in panels)[order]
    special = np.array([i in (0, 1, lower.size - 1) or (lower[i] < 0 < upper[i]) for i in order])
    used = np.flatnonzero((total > 0) | special)
    keep = np.zeros(order.size, bool)
    inner = np.flatnonzero((total > 0) & ~special)
    if inner.size:
        keep[inner.min():inner.max() + 1] = True
    keep |= special
    rows = order[keep] if used.size else order
    # The special rows (+Inf, zero, -Inf, NaN) drawn taller than a magnitude bin, so that a tensor
    # gone NaN, or gradients that are all exactly zero, are seen at a glance.
    heights = np.array([max(1.0, 0.05 * len(rows)) if _is_special(b, lower, upper) else 1.0 for b in rows])
    y_edges = np.concatenate([[0.0], np.cumsum(heights)])
    for ax_, (title, steps, counts) in zip(axes, panels):
        edges = plots.bucket_edges(len(steps), HIST_COLS)
        summed = np.add.reduceat(counts, edges[:-1], axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = summed / summed.sum(axis=1, keepdims=True)
            values = np.log10(np.where(share > 0, share, np.nan))[:, rows].T
        bad = np.zeros_like(values, dtype=bool)
        for r, b in enumerate(rows):
            if b in (0, 1, lower.size - 1):
                bad[r] = np.isfinite(values[r])
        gap = int(np.median(np.diff(steps))) if len(steps) > 1 else 1
        last = steps[-1] + (min(gap, end - steps[-1]) if end is not None and end > steps[-1] else gap)
        extent = (float(steps[0]), float(last))
        if len(edges) - 1 == len(steps) and len(steps) > 1:
            # Each histogram a narrow column at the step it was taken, background between: a
            # sample is not drawn as if it held until the next one.
            x_edges, values, bad = _at_their_steps(np.asarray(steps, dtype=np.float64), values, bad)
        else:  # buckets of many samples: each column from its first sample to the next bucket's
            x_edges = np.append(steps[edges[:-1]], last).astype(np.float64)
        cmap = plots.matplotlib.colormaps["viridis"].with_extremes(bad="#eceff1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ax_.set_facecolor("#eceff1")
            ax_.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(np.where(bad, np.nan, values)), cmap=cmap,
                           vmin=-6, vmax=0, shading="flat")
            if bad.any():
                ax_.pcolormesh(x_edges, y_edges, np.ma.masked_where(~bad, np.ones_like(values)),
                               cmap=ListedColormap([plots.NONFINITE_COLOR]), vmin=0, vmax=1, shading="flat")
        ax_.set_ylim(y_edges[-1], y_edges[0])
        ax_.grid(False)
        ax_.set_title(title)
        ax_.set_xlabel("step")
        for step, severity, *_ in marks:
            ax_.axvline(step, color=plots.SEVERITY_COLORS.get(severity, "gray"), ls=":", lw=1.4)
        ax_.set_xlim(extent[0], extent[1])
        plots._step_ticks(ax_)
    centers = (y_edges[:-1] + y_edges[1:]) / 2
    ticks, labels = _row_ticks(rows, lower, upper, heights)
    axes[0].set_yticks([float(centers[r]) for r in ticks])
    axes[0].set_yticklabels(labels, fontsize=6)
    sm = plots.matplotlib.cm.ScalarMappable(norm=plots.matplotlib.colors.Normalize(-6, 0),
                                            cmap=plots.matplotlib.colormaps["viridis"])
    cb = fig.colorbar(sm, cax=colorbar_ax)
    cb.set_ticks([-6, -4, -2, 0])
    cb.set_ticklabels(["1e-6", "1e-4", "0.01", "1"], fontsize=6)
    cb.set_label("share of elements", fontsize=7)


def _is_special(b: int, lower: np.ndarray, upper: np.ndarray) -> bool:
    """The rows always shown: NaN, -Inf, +Inf and the bin around zero."""
    return b in (0, 1, lower.size - 1) or bool(lower[b] < 0 < upper[b])


def _row_ticks(rows, lower: np.ndarray, upper: np.ndarray, heights: np.ndarray):
    """Labelled rows: the special ones, and the bins holding a power of ten (every k-th decade so
    that about ten are labelled), away from the special rows."""
    fixed = [r for r, b in enumerate(rows) if _is_special(b, lower, upper)]
    decades = []
    for r, b in enumerate(rows):
        lo, hi = float(lower[b]), float(upper[b])
        if _is_special(b, lower, upper) or not (np.isfinite(lo) and np.isfinite(hi)) or lo == 0 or hi == 0:
            continue
        mag_lo, mag_hi = (lo, hi) if lo > 0 else (-hi, -lo)
        k = int(np.ceil(np.log10(mag_lo)))
        if mag_lo <= 10.0 ** k < mag_hi:
            decades.append((r, k, "+" if lo > 0 else "-"))
    stride = max(1, int(np.ceil(len(decades) / 10)))
    pos = np.concatenate([[0.0], np.cumsum(heights)])
    centers = (pos[:-1] + pos[1:]) / 2
    room = 0.055 * pos[-1]  # a label's height, in rows
    ticks = {r: _bin_label(lower[rows[r]], upper[rows[r]], rows[r]) for r in fixed}
    for r, k, sign in decades:
        if k % stride or min(abs(centers[r] - centers[t]) for t in fixed) < room:
            continue
        ticks[r] = sign + ("1" if k == 0 else "10" if k == 1 else f"1e{k}")
    order = sorted(ticks)
    # The two bottom rows (-Inf, NaN): one label between them where they are too close for two.
    if (len(order) >= 2 and [ticks[r] for r in order[-2:]] == ["-Inf", "NaN"]
            and centers[order[-1]] - centers[order[-2]] < room):
        ticks.pop(order[-2])
        ticks[order[-1]] = "-Inf, NaN"
        order = order[:-2] + [order[-1]]
    return order, [ticks[r] for r in order]


# -- one layer's weights before and after the first finding ---------------------------------------
# Findings about memory or time, not about the values of the weights: no before/after picture.
NOT_ABOUT_WEIGHTS = ("memory_leak", "out_of_memory", "slow_steps", "dataloader_bottleneck", "host_device_copies")


def _finding(ctx: Context, rt: RankTrace) -> Finding | None:
    """The first problem in time (as the verdict names it) among those about the weights' values."""
    return first_to_go_wrong([f for f in ctx.findings if f.rank in (None, rt.rank)
                              and f.kind not in NOT_ABOUT_WEIGHTS])


def _values(rt: RankTrace, source: str, step: int, name: str) -> np.ndarray | None:
    rows = rt.tensors_of(source, step)
    rows = rows[rows["name"] == name]
    if rows.empty:
        return None
    dtype = str(rows["dtype"].iloc[0])
    raw = rt.read_tensor_bytes(rows, verify_snapshot=step if source == "snapshot" else None)[0]
    if dtype == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype not in ("float16", "float32", "float64"):
        return None
    return np.frombuffer(raw, np.dtype(dtype)).astype(np.float64)


def _snapshot_figure(ctx: Context, rt: RankTrace) -> Figure | None:
    f = _finding(ctx, rt)
    if f is None:
        return None
    snaps = rt.snapshots
    if not len(snaps):
        return None
    title = ctx.title_rank("Weights before and after the first finding", rt.rank)
    # The layer: the first weight the finding names (a module's own weight), else the largest.
    # A bias the finding names stands for its layer: its weight comes first (a handful of bias values
    # makes no distribution to look at).
    candidates = []
    for w in f.where:
        for c in ((w[:-len("bias")] + "weight", w) if w.endswith(".bias") else (w, f"{w}.weight")):
            if c in rt.param_names and c not in candidates:
                candidates.append(c)
    weights = ctx.weights(rt)
    numel = lambda n: rt.param_numel[rt.param_names.index(n)]  # noqa: E731
    name = (next((c for c in candidates if numel(c) >= 16), candidates[0]) if candidates else
            max(weights, key=numel) if weights else None)
    if name is None:
        return None
    # Every stored copy of the parameters: the snapshots, and the black box's (the start of the
    # bad step). The one nearest before the finding, and the one nearest after it.
    stored = [(int(x), "snapshot") for x in snaps["step"]]
    series = []
    try:
        bb = rt.blackbox
        if len(bb) and bb["params_at"].iloc[0] == "start_of_step":
            stored.append((int(bb["step"].iloc[0]), "blackbox"))
        before = max((x for x in stored if x[0] <= f.step), default=None)
        after = min((x for x in stored if x[0] > f.step), default=None)
        for chosen in (before, after):
            if chosen is None:
                continue
            v = _values(rt, chosen[1], chosen[0], name)
            if v is not None:
                label = "black box" if chosen[1] == "blackbox" else "snapshot"
                series.append((f"{label}, start of step {chosen[0]:,}", v))
    except TraceError as e:
        return no_figure(title, f"The snapshots could not be read ({e}).")
    if not series:
        return None
    same = ""
    if len(series) == 2 and series[0][1].shape == series[1][1].shape:
        a, b = series[0][1], series[1][1]
        ok = np.isfinite(a) & np.isfinite(b)
        if ok.all():
            change = float(np.max(np.abs(b - a))) if a.size else 0.0
            scale = float(np.max(np.abs(a))) if a.size else 0.0
            if change <= 1e-3 * scale:
                same = (" The two outlines coincide: not one element changed." if change == 0 else
                        " The two outlines coincide: no element changed by more than "
                        f"{change:.2g} (the largest |value| is {scale:.2g}).")
    for label, v in series:
        if v.size and not np.isfinite(v).any():
            same += (f" The {label.split(',')[0]} at step {label.rsplit(' ', 1)[-1]} holds no finite value: "
                     "nothing of it to draw.")
    why = "" if candidates else " (the finding names no parameter: the largest weight tensor)"
    caption = (f"Distribution of the values of {name}{why} at the stored parameters nearest before and after the "
               f"{f.kind} finding at step {f.step:,}: share of the elements per value bin (finite values; the "
               "legend gives the share of NaN and Inf, which have no place on the axis)." +
               ("" if len(series) == 2 else " Only one side is stored (snapshots are sparse; the black box "
                                            "holds the state just before a NaN/Inf).") + same)
    return figure(title, caption, plot_value_distribution, series, height_in=2.6)


# Bins of the before/after comparison: linear over the finite values of both.
VALUE_BINS = 60


def plot_value_distribution(series, ax) -> None:
    """Share of a tensor's finite values per bin (common bins for all series); the share of NaN
    and of +-Inf in each series' legend entry. Linear bins, unless the series' scales differ by
    more than 100x (weights that exploded): then bins of log magnitude either side of zero, on a
    symlog axis, so that both distributions stay visible."""
    finite = [v[np.isfinite(v)] for _, v in series]
    allv = np.concatenate(finite) if finite else np.zeros(0)
    lo, hi = (float(allv.min()), float(allv.max())) if allv.size else (-1.0, 1.0)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    # Fewer bins for a small tensor, so that its few values still make a shape.
    n_bins = int(np.clip(2 * np.sqrt(max(f.size for f in finite) if finite else 0), 10, VALUE_BINS))
    edges = np.linspace(lo, hi, n_bins + 1)
    scales = [float(np.median(np.abs(f))) for f in finite if f.size]
    scales = [x for x in scales if x > 0]
    top = float(np.abs(allv).max()) if allv.size else 0.0
    if scales and top > 100 * min(scales):
        small = min(scales) / 100  # |x| below this shares the bin around zero
        side = np.geomspace(small, top * 1.0001, n_bins // 2)
        edges = np.concatenate([-side[::-1], side])
        ax.set_xscale("symlog", linthresh=small)
        # Ticks at 0 and at every k-th power of ten past the linear part, so that labels never
        # crowd around zero.
        k_lo, k_hi = int(np.ceil(np.log10(small))) + 1, int(np.floor(np.log10(top * 1.0001)))
        if k_hi >= k_lo:
            stride = max(1, int(np.ceil((k_hi - k_lo + 1) / 5)))
            ks = list(range(k_hi, k_lo - 1, -stride))
            ax.set_xticks(sorted([-(10.0 ** k) for k in ks] + [0.0] + [10.0 ** k for k in ks]))
            ax.xaxis.set_minor_locator(plots.matplotlib.ticker.NullLocator())
    for (label, v), f, color in zip(series, finite, plots.EMPHASIS_COLORS):
        n = max(1, v.size)
        counts, _ = np.histogram(f, bins=edges)
        nan, inf = int(np.isnan(v).sum()), int(np.isinf(v).sum())
        extra = "".join(f", {k} {c / n:.0%}" for k, c in (("NaN", nan), ("Inf", inf)) if c)
        ax.stairs(counts / n, edges, color=color, lw=1.4, label=f"{label}{extra}")
    ax.set_ylabel("share of elements")
    ax.set_xlabel("value" + (" (log scale either side of zero)" if ax.get_xscale() == "symlog" else ""))
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(series), frameon=False)  # above: no bar hidden
