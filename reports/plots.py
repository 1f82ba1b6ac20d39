"""Figures of a report: ``plot_*(data, ax)`` functions, and the PNG they become.

Figures are drawn on a bare ``matplotlib.figure.Figure`` (the Agg canvas) rather than through
pyplot: no GUI backend is ever chosen, no global figure list grows, and the caller's own pyplot
state is left alone. Labels come from traces (parameter names): ``$`` is escaped in them, so
matplotlib never parses a name as mathtext.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

# At most this many points per line: enough for a 10-inch figure, small enough to stay fast.
MAX_POINTS = 2000
# More lines than this in one plot cannot be told apart; the rest are named in the caption.
MAX_LINES = 12
SEVERITY_COLORS = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
_RC = {"font.size": 9, "axes.grid": True, "grid.alpha": 0.3}


def png_data_uri(plot: Callable, *args, figsize=(10, 3.6), **kwargs) -> str:
    """Draw ``plot(*args, ax=ax, **kwargs)`` on a new figure; return it as a PNG ``data:`` URI."""
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=figsize, dpi=100, layout="constrained")
        plot(*args, ax=fig.add_subplot(), **kwargs)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def downsample_minmax(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS):
    """At most ``max_points`` of (x, y), keeping each bucket's min and max so spikes survive.

    NaN is skipped within a bucket; a bucket of only NaN keeps one NaN, so gaps stay gaps.
    """
    x, y = np.asarray(x), np.asarray(y, dtype=np.float64)
    if len(y) <= max_points:
        return x, y
    edges = np.linspace(0, len(y), max_points // 2 + 1).astype(np.int64)
    keep: list[int] = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        seg = y[lo:hi]
        if np.isnan(seg).all():
            keep.append(int(lo))
        else:
            keep.extend(sorted({int(lo + np.nanargmin(seg)), int(lo + np.nanargmax(seg))}))
    return x[keep], y[keep]


def plot_loss(losses: dict[str, pd.Series], ax, marks: Sequence[tuple[int, str, str]] = ()) -> None:
    """Loss over steps, one line per label (rank), with the findings' steps as vertical lines.

    ``marks`` are (step, severity, label). NaN/Inf losses leave gaps. The y axis is logarithmic
    when the losses are positive and span more than two orders of magnitude.
    """
    finite_all = []
    for label, s in losses.items():
        y = _finite_or_nan(s.to_numpy())
        ax.plot(*downsample_minmax(s.index.to_numpy(), y), lw=1.2, label=label)
        finite_all.append(y[np.isfinite(y)])
    values = np.concatenate(finite_all) if finite_all else np.empty(0)
    if values.size and values.min() > 0 and values.max() / values.min() > 100:
        ax.set_yscale("log")
    _mark_steps(ax, marks)
    _step_axis(ax, [s.index.to_numpy() for s in losses.values()])
    ax.set_ylabel("loss")
    _legend(ax, loc="best", fontsize=8)


def largest_columns(df: pd.DataFrame, n: int = MAX_LINES, keep: Sequence[str] = ()) -> list[str]:
    """Up to ``n`` columns, in their original order: those in ``keep`` first, then the ones
    with the largest finite positive value. Columns with no such value are never chosen."""
    peak = np.fmax.reduce(_positive_or_nan(df.to_numpy()), axis=0, initial=-np.inf)
    keep = set(keep)
    pinned = [j for j, c in enumerate(df.columns) if c in keep and peak[j] > -np.inf]
    ranked = [j for j in np.argsort(-peak, kind="stable")
              if peak[j] > -np.inf and df.columns[j] not in keep]
    return [df.columns[j] for j in sorted((pinned + ranked)[:n])]


def plot_grad_norms(grad_norm: pd.DataFrame, ax, total: pd.Series | None = None,
                    marks: Sequence[tuple[int, str, str]] = ()) -> None:
    """Gradient L2 norm of each parameter (column) over steps, log scale, early layers dark.

    ``total`` (the norm of all gradients together) is drawn dashed black. Zero, NaN and Inf
    norms leave gaps: a log scale has no place for them.
    """
    steps = grad_norm.index.to_numpy()
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(grad_norm.shape[1], 1)))
    for color, name in zip(colors, grad_norm.columns):
        ax.plot(*downsample_minmax(steps, _positive_or_nan(grad_norm[name].to_numpy())),
                lw=1, color=color, label=shorten(str(name)))
    if total is not None:
        ax.plot(*downsample_minmax(total.index.to_numpy(), _positive_or_nan(total.to_numpy())),
                lw=1.8, color="black", ls="--", label="total")
    if _has_data(ax):
        ax.set_yscale("log")
    _mark_steps(ax, marks, legend=False)
    _step_axis(ax, [steps])
    ax.set_ylabel("gradient L2 norm")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def shorten(text: str, width: int = 40) -> str:
    """``text`` as a plot label: cut in the middle to ``width`` characters, ``$`` kept literal."""
    if len(text) > width:
        half = (width - 1) // 2
        text = text[:half] + "…" + text[len(text) - (width - 1 - half):]
    return text.replace("$", r"\$")


def _mark_steps(ax, marks: Sequence[tuple[int, str, str]], legend: bool = True) -> None:
    for step, severity, label in marks:
        ax.axvline(step, color=SEVERITY_COLORS.get(severity, "gray"), ls=":", lw=1.4,
                   label=shorten(label) if legend else None)


def _step_axis(ax, step_arrays: Sequence[np.ndarray] = ()) -> None:
    """Label the step axis; span every recorded step, so that steps after a run went NaN (gaps
    in the lines) still show as part of the run."""
    spans = [a for a in step_arrays if len(a)]
    if spans:
        lo, hi = min(a.min() for a in spans), max(a.max() for a in spans)
        if hi > lo:
            ax.set_xlim(lo, hi)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend(ax, **kwargs) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _has_data(ax) -> bool:
    """Whether any line drawn so far has a finite point (an empty log axis would warn)."""
    return any(np.isfinite(line.get_ydata()).any() for line in ax.get_lines())


def _finite_or_nan(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    return np.where(np.isfinite(y), y, np.nan)


def _positive_or_nan(y: np.ndarray) -> np.ndarray:
    y = _finite_or_nan(y)
    return np.where(y > 0, y, np.nan)
