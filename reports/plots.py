"""Figures of a report: ``plot_*(data, ax)`` functions that only draw, and the PNG they become.

Figures are drawn on a bare ``matplotlib.figure.Figure`` (the Agg canvas) rather than through
pyplot: no GUI backend is ever chosen, no global figure list grows, and the caller's own pyplot
state is left alone. Labels come from traces (parameter names): ``$`` is escaped in them, so
matplotlib never parses a name as mathtext.

Every figure is drawn FIG_WIDTH_IN wide, the text width of an A4 page with 15 mm margins, with
8-point text: the PDF places it at that size (readable at 100%), the HTML at about the same.
"""

from __future__ import annotations

import base64
import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..analyzer.display import shorten as _shorten
from .plot_layout import fit_margins, plain_log_labels

FIG_WIDTH_IN = 7.0
DPI = 150
# At most this many points per line: enough for a 7-inch figure at 150 dpi, small enough to stay
# fast; each bucket keeps its min and its max, so spikes survive.
MAX_POINTS = 2000
# More lines than this in one plot cannot be told apart; the rest are named in the caption.
MAX_LINES = 12
# A line's name in a legend, cut to this many characters.
LINE_LABEL_CHARS = 32
SEVERITY_COLORS = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
# Lines a finding names: strong, distinct colours (no red or orange: those mark events and thresholds).
EMPHASIS_COLORS = ("#1f77b4", "#9467bd", "#2ca02c", "#8c564b", "#17becf", "#e377c2", "#bcbd22", "#37474f")
NONFINITE_COLOR = "#d50000"
_RC = {"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "legend.fontsize": 7,
       "xtick.labelsize": 7, "ytick.labelsize": 7, "axes.grid": True, "grid.alpha": 0.3,
       "axes.spines.top": False, "axes.spines.right": False,
       "text.usetex": False}  # a user's matplotlibrc may set it: LaTeX would choke on names (_, #, %)

Mark = tuple[int, str, str, str]  # (step, severity, label, marker): a vertical line at a finding's step
# Each finding kind's marker, on the top edge of a figure's line at its step and in the timeline:
# findings that share a step or a colour are still told apart.
MARKERS = ("D", "o", "s", "^", "v", "P", "X", "*", "h", "<", ">", "p")


@dataclass(frozen=True)
class Line:
    label: str
    x: np.ndarray
    y: np.ndarray
    emphasis: bool = False  # named by the finding: thick, a strong colour, first in the legend
    color: str | None = None
    style: str = "-"
    marker: str | None = None
    width: float | None = None


def render_png(plot: Callable, *args, height_in: float = 2.8, **kwargs) -> bytes:
    """Draw ``plot(*args, ax=ax, **kwargs)`` on a new figure; return it as PNG bytes."""
    with matplotlib.rc_context(_RC), warnings.catch_warnings():
        # Names from traces may hold characters DejaVu Sans lacks (CJK, emoji): they draw as boxes.
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig = Figure(figsize=(FIG_WIDTH_IN, height_in), dpi=DPI)
        FigureCanvasAgg(fig)
        plot(*args, ax=fig.add_subplot(), **kwargs)
        plain_log_labels(fig)
        fit_margins(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# -- downsampling ---------------------------------------------------------------------------------
def downsample_minmax(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS):
    """At most ``max_points`` of (x, y), keeping each bucket's min and max so spikes survive.

    NaN is skipped within a bucket; a bucket of only NaN keeps one NaN, so gaps stay gaps.
    Vectorised: a million points take milliseconds.
    """
    x, y = np.asarray(x), np.asarray(y, dtype=np.float64)
    n = len(y)
    if n <= max_points:
        return x, y
    n_buckets = max_points // 2
    starts = np.linspace(0, n, n_buckets + 1).astype(np.int64)[:-1]
    sizes = np.diff(np.append(starts, n))
    nan = np.isnan(y)
    lo_val = np.where(nan, np.inf, y)
    hi_val = np.where(nan, -np.inf, y)
    keep = [starts]  # a bucket of only NaN keeps its first point (a NaN): the gap stays
    for vals, reduce in ((lo_val, np.minimum), (hi_val, np.maximum)):
        best = np.repeat(reduce.reduceat(vals, starts), sizes)
        hit = np.flatnonzero((vals == best) & ~nan)
        bucket = np.repeat(np.arange(n_buckets), sizes)[hit]
        _, first = np.unique(bucket, return_index=True)  # first position of each bucket's extreme
        keep.append(hit[first])
    all_nan = np.logical_and.reduceat(nan, starts)
    keep = np.unique(np.concatenate([keep[0][all_nan], keep[1], keep[2]]))
    return x[keep], y[keep]


def bucket_edges(n: int, max_buckets: int) -> np.ndarray:
    """Row indices splitting ``n`` rows into at most ``max_buckets`` contiguous buckets."""
    return np.unique(np.linspace(0, n, min(n, max_buckets) + 1).astype(np.int64))


# -- plots ----------------------------------------------------------------------------------------
def plot_lines(lines: Sequence[Line], ax, *, log: bool = False, ylabel: str = "",
               marks: Sequence[Mark] = (), hlines: Sequence[tuple[float, str, str, str]] = (),
               xspan: tuple[float, float] | None = None, nonfinite_at: Sequence[tuple[float, str]] = (),
               legend: bool = True, ylim: tuple[float, float] | None = None, xlabel: str = "step",
               nonfinite_label: str = "went NaN/Inf") -> None:
    """Lines over steps. Lines with ``emphasis`` are thick and coloured, the others thin, in a
    sequential colormap (early layers dark) or grey beside emphasised ones. NaN/Inf (and, on a log
    scale, negative values) leave gaps; on a log scale an exact 0 is a triangle on the bottom edge,
    in its line's colour, not a gap (a gradient that is exactly zero is news). ``hlines``: (y, label, colour, style); ``marks``: vertical lines
    at findings' steps; ``nonfinite_at``: (step, label) red crosses on the top edge, where a line
    went NaN/Inf."""
    emphasised = [ln for ln in lines if ln.emphasis]
    others = [ln for ln in lines if not ln.emphasis]
    seq = matplotlib.colormaps["viridis"](np.linspace(0, 0.85, max(len(others), 1)))
    drawn = []
    for i, ln in enumerate(others):
        color = ln.color or ("#9e9e9e" if emphasised else seq[i])
        _line(ax, ln, log, color, ln.width or (0.8 if emphasised else 1.1), zorder=2)
        drawn.append((ln, color))
    for i, ln in enumerate(emphasised):
        color = ln.color or EMPHASIS_COLORS[i % len(EMPHASIS_COLORS)]
        _line(ax, ln, log, color, ln.width or 1.8, zorder=3)
        drawn.append((ln, color))
    if log and _has_data(ax):
        ax.set_yscale("log")
        _zeros_on_bottom_edge(ax, drawn)
    for y, label, color, style in hlines:
        if not log or y > 0:
            ax.axhline(y, color=color, ls=style, lw=1.1, label=_label(label), zorder=1)
    _mark_steps(ax, marks)
    if nonfinite_at:
        xs = [s for s, _ in nonfinite_at]
        ax.scatter(xs, [1.0] * len(xs), transform=ax.get_xaxis_transform(), marker="x", s=28,
                   color=NONFINITE_COLOR, clip_on=False, zorder=5, label=nonfinite_label)
    if ylim is not None:
        ax.set_ylim(*ylim)
    _step_axis(ax, xspan, [ln.x for ln in lines], xlabel)
    ax.set_ylabel(ylabel)
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            # Emphasised lines first: the legend reads as "these, against the rest".
            first = {_label(ln.label, LINE_LABEL_CHARS) for ln in emphasised}
            order = sorted(range(len(labels)), key=lambda i: labels[i] not in first)
            ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
                      bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)


def plot_loss(losses: dict[str, pd.Series], ax, marks: Sequence[Mark] = (),
              smoothed: dict[str, pd.Series] | None = None, extra: Sequence[Line] = (),
              hlines=(), spans: Sequence[tuple[float, float, float, float, str]] = (),
              xspan: tuple[float, float] | None = None, nonfinite_at: Sequence[tuple[float, str]] = ()) -> None:
    """Loss over steps, one line per label (rank), with the findings' steps as vertical lines.

    ``smoothed``: trailing medians drawn thick over the raw loss. ``spans``: shaded rectangles
    (x0, x1, y0, y1, label). NaN/Inf losses leave gaps. The y axis is logarithmic when the losses
    are positive and span more than two orders of magnitude.
    """
    lines = [Line(label, s.index.to_numpy(), _finite_or_nan(s.to_numpy()),
                  width=0.8 if smoothed else 1.2, color="#90a4ae" if smoothed and len(losses) == 1 else None)
             for label, s in losses.items()]
    for label, s in (smoothed or {}).items():
        lines.append(Line(label, s.index.to_numpy(), _finite_or_nan(s.to_numpy()), emphasis=True))
    lines += list(extra)
    values = np.concatenate([ln.y[np.isfinite(ln.y)] for ln in lines]) if lines else np.empty(0)
    log = bool(values.size and values.min() > 0 and values.max() / values.min() > 100)
    for x0, x1, y0, y1, label in spans:
        ax.fill_between([x0, x1], [y0, y0], [y1, y1], color="#ffe082", alpha=0.5, lw=0, label=_label(label))
    plot_lines(lines, ax, log=log, ylabel="loss", marks=marks, hlines=hlines, xspan=xspan,
               nonfinite_at=nonfinite_at)


def plot_memory(series: dict[str, tuple[np.ndarray, np.ndarray]], ax, *, fit: Line | None = None,
                census: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                marks: Sequence[Mark] = (), xspan=None, own_steps: np.ndarray | None = None) -> None:
    """Memory in MiB over steps, one line per series; ``fit`` dashed; ``census`` (steps, live
    tensors, of which holding a graph) as markers on a second axis; ``own_steps``, steps of the
    recorder's own census, as grey ticks on the bottom edge (its work, not the user's)."""
    lines = [Line(label, x, y) for label, (x, y) in series.items()]
    if fit is not None:
        lines.append(fit)
    if series:  # the peak of the first series (the one the findings read), as a star
        label, (x, y) = next(iter(series.items()))
        y = np.asarray(y, dtype=float)
        if np.isfinite(y).any():
            i = int(np.nanargmax(y))
            lines.append(Line(f"peak {y[i]:,.0f} MiB at step {int(x[i]):,}", np.asarray([x[i]]),
                              np.asarray([y[i]]), color="black", style="none", marker="*", width=0))
    if own_steps is not None and len(own_steps):
        ax.scatter(own_steps, np.zeros(len(own_steps)), transform=ax.get_xaxis_transform(), marker="|", s=40,
                   color="#9e9e9e", clip_on=False, zorder=4, label="the recorder's census")
    plot_lines(lines, ax, ylabel="MiB", marks=marks, xspan=xspan, legend=census is None)
    if census is not None:
        steps, n, g = census
        ax2 = ax.twinx()
        ax2.plot(steps, n, "o", ms=3.5, color="#6d4c41", label="live tensors (census)")
        ax2.plot(steps, g, "^", ms=3.5, color="#ad1457", label="… holding an autograd graph")
        ax2.set_ylabel("live tensors")
        ax2.grid(False)
        ax2.spines["right"].set_visible(True)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)


def plot_stacked(x: np.ndarray, layers: dict[str, np.ndarray], ax, *, ylabel: str,
                 colors: Sequence[str] = (), hlines=(), points: tuple[np.ndarray, np.ndarray] | None = None,
                 points_label: str = "", marks: Sequence[Mark] = (), xspan=None,
                 ymax: float | None = None, peak: np.ndarray | None = None,
                 bands: Sequence[tuple[float, float]] = (), bands_label: str = "") -> None:
    """Layers stacked over steps (the phases of a step). Long runs are bucketed: each layer's mean
    per bucket (areas stay true), and the largest total of each bucket drawn as a thin line on
    top, so a slow step is never averaged away. ``points``: (steps, values) marked with crosses.
    ``ymax``: cut the axis there (so one huge step does not flatten the rest); points above it are
    drawn on the top edge as triangles with their value. ``peak``: given when the caller bucketed
    the layers already (each bucket's largest total). ``bands``: (first, last) steps shaded grey
    behind the layers (``bands_label`` in the legend once)."""
    for k, (lo, hi) in enumerate(bands):
        ax.axvspan(lo - 0.5, hi + 0.5, color="#e0e0e0", lw=0, zorder=0, label=_label(bands_label) if k == 0 else None)
    x = np.asarray(x, dtype=float)
    ys = np.stack([np.nan_to_num(np.asarray(v, dtype=float), nan=0.0) for v in layers.values()])
    total = ys.sum(axis=0)
    if peak is None and len(x) > MAX_POINTS:
        starts = bucket_edges(len(x), MAX_POINTS // 2)[:-1]
        counts = np.diff(np.append(starts, len(x)))
        ys = np.add.reduceat(ys, starts, axis=1) / counts
        peak = np.maximum.reduceat(total, starts)
        x = x[starts]
    ax.stackplot(x, ys, labels=[_label(k, 52) for k in layers], colors=list(colors) or None, alpha=0.85, lw=0,
                 step="mid")  # a step's time holds for that step: no slopes between steps
    if peak is not None:
        ax.plot(x, peak, color="#424242", lw=0.6, label="slowest step in each bucket")
    if points is not None and len(points[0]):
        px, py = np.asarray(points[0], dtype=float), np.asarray(points[1], dtype=float)
        over = py > ymax if ymax is not None else np.zeros(len(py), dtype=bool)
        ax.scatter(px[~over], py[~over], marker="x", s=24, color=NONFINITE_COLOR, zorder=5,
                   label=_label(points_label))
        if over.any():
            ax.scatter(px[over], np.full(over.sum(), ymax * 0.97), marker="^", s=30, color=NONFINITE_COLOR,
                       zorder=5, clip_on=False, label=_label(f"{points_label} (off the scale)"))
            right = float(np.nanmax(x)) if len(x) else 0.0
            left = float(np.nanmin(x)) if len(x) else 0.0
            for x_, y_ in zip(px[over], py[over]):
                near_end = x_ > left + 0.9 * (right - left)  # label to the left, clear of the legend
                ax.annotate(f"{y_:,.0f}", (x_, ymax * 0.97), xytext=(-4 if near_end else 4, -9),
                            textcoords="offset points", fontsize=7, color=NONFINITE_COLOR,
                            ha="right" if near_end else "left")
    for y, label, color, style in hlines:
        ax.axhline(y, color=color, ls=style, lw=1.1, label=_label(label))
    _mark_steps(ax, marks)
    _step_axis(ax, xspan, [x], "step")
    ax.set_ylim(bottom=0, top=ymax)
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)


def plot_timeline(events: Sequence[tuple[str, int, str, str]], ax, *, xspan: tuple[float, float]) -> None:
    """One row per finding (label, step, severity, marker), its kind's marker at its first step."""
    n = len(events)
    for i, (label, step, severity, marker) in enumerate(events):
        color = SEVERITY_COLORS.get(severity, "gray")
        ax.hlines(i, xspan[0], step, color="#e0e0e0", lw=1)
        ax.plot([step], [i], marker, color=color, ms=6)
        ax.annotate(f"{step:,}", (step, i), xytext=(6, 0), textcoords="offset points", va="center",
                    fontsize=6.5, color="#424242")
    ax.set_yticks(range(n))
    ax.set_yticklabels([_label(e[0], 48) for e in events])
    ax.set_ylim(n - 0.5, -0.5)
    for sev, color in SEVERITY_COLORS.items():
        if any(e[2] == sev for e in events):
            ax.plot([], [], "s", color=color, label=sev)
    ax.grid(axis="y", visible=False)
    _step_axis(ax, xspan, [], "step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)


# -- helpers --------------------------------------------------------------------------------------
def largest_columns(df: pd.DataFrame, n: int = MAX_LINES, keep: Sequence[str] = ()) -> list[str]:
    """Up to ``n`` columns, in their original order: those in ``keep`` first, then the ones
    with the largest finite positive value. Columns with no such value are never chosen."""
    peak = np.fmax.reduce(_positive_or_nan(df.to_numpy()), axis=0, initial=-np.inf)
    keep = set(keep)
    pinned = [j for j, c in enumerate(df.columns) if c in keep and peak[j] > -np.inf]
    ranked = [j for j in np.argsort(-peak, kind="stable")
              if peak[j] > -np.inf and df.columns[j] not in keep]
    return [df.columns[j] for j in sorted((pinned + ranked)[:n])]


def shorten(text: str, width: int = 40) -> str:
    """``text`` as a plot label: cut in the middle to ``width`` characters, ``$`` kept literal."""
    return _label(text, width)


def _label(text: str, width: int = 40) -> str:
    return _shorten(text, width).replace("$", r"\$")


def _line(ax, ln: Line, log: bool, color, width: float, zorder: int) -> None:
    y = _positive_or_nan(ln.y) if log else _finite_or_nan(ln.y)
    x, y = downsample_minmax(np.asarray(ln.x), y)
    ax.plot(x, y, ls=ln.style, lw=width, color=color, marker=ln.marker, ms=9 if ln.marker == "*" else 3.5,
            label=_label(ln.label, LINE_LABEL_CHARS) if ln.label else None, zorder=zorder)


def _zeros_on_bottom_edge(ax, drawn) -> None:
    """Exact zeros of lines on a log scale, as triangles on the bottom edge (one legend entry)."""
    label = "exactly 0 (bottom edge)"
    for ln, color in drawn:
        x = np.asarray(ln.x, dtype=np.float64)
        zero = np.asarray(ln.y, dtype=np.float64) == 0
        if not zero.any():
            continue
        xs = x[zero]
        if xs.size > MAX_POINTS:  # a long run of zeros: evenly spread, its ends kept
            xs = xs[np.unique(np.linspace(0, xs.size - 1, MAX_POINTS).astype(int))]
        ax.scatter(xs, np.zeros(xs.size), transform=ax.get_xaxis_transform(), marker="v", s=16,
                   color=color, clip_on=False, zorder=4, label=label)
        label = None


# More marks than this are drawn without legend entries (a legend taller than the figure).
MAX_MARK_LABELS = 8


def _mark_steps(ax, marks: Sequence[Mark]) -> None:
    labelled = len(marks) <= MAX_MARK_LABELS
    for step, severity, label, marker in marks:
        color = SEVERITY_COLORS.get(severity, "gray")
        ax.axvline(step, color=color, ls=":", lw=1.4, label=_label(label, 32) if label and labelled else None, zorder=1)
        ax.scatter([step], [1.0], transform=ax.get_xaxis_transform(), marker=marker, s=22, color=color,
                   clip_on=False, zorder=5)


def _step_axis(ax, xspan, step_arrays: Sequence[np.ndarray], xlabel: str) -> None:
    """Label the step axis; span every recorded step (or ``xspan``), so that steps after a run
    went NaN (gaps in the lines) still show as part of the run."""
    if xspan is None:
        spans = [np.asarray(a) for a in step_arrays if len(a)]
        if spans:
            xspan = (min(a.min() for a in spans), max(a.max() for a in spans))
    if xspan is not None and xspan[1] > xspan[0]:
        ax.set_xlim(*xspan)
    ax.set_xlabel(xlabel)
    _step_ticks(ax)


def _step_ticks(ax) -> None:
    """Whole steps, few enough to read beside a legend; 10k for 10,000 and up."""
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if abs(x) >= 10_000 else f"{x:g}"))


def _has_data(ax) -> bool:
    """Whether any line drawn so far has a finite point (an empty log axis would warn)."""
    return any(np.isfinite(np.asarray(line.get_ydata(), dtype=float)).any() for line in ax.get_lines())


def _finite_or_nan(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    return np.where(np.isfinite(y), y, np.nan)


def _positive_or_nan(y: np.ndarray) -> np.ndarray:
    y = _finite_or_nan(y)
    return np.where(y > 0, y, np.nan)
