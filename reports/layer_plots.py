"""Figures by layer: a layers x steps heatmap (the gradient norm of each layer at each step) and
one bar per layer. Drawn with the style and helpers of plots.py."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib
import numpy as np
from matplotlib.colors import ListedColormap

from .plots import NONFINITE_COLOR, SEVERITY_COLORS, Mark, _label, _positive_or_nan, _step_ticks

ZERO_COLOR = "#212121"  # a heatmap cell that is exactly 0 (a gradient of zeros, not a missing one)


def plot_heatmap(values: np.ndarray, row_labels: Sequence[str], x_edges: np.ndarray, ax, *,
                 nonfinite: np.ndarray | None = None, zero: np.ndarray | None = None, cbar_label: str = "",
                 marks: Sequence[Mark] = (), empty_label: str = "") -> None:
    """A rows x step-buckets matrix on a colour scale (``values`` already log10; NaN: nothing
    recorded, light grey, in the legend as ``empty_label`` if given); ``nonfinite`` cells (NaN/Inf)
    in red, ``zero`` cells (exactly 0) in black. ``x_edges``: the first step of each column and
    the end of the last."""
    values = np.asarray(values, dtype=np.float64)
    n_rows = values.shape[0]
    extent = (float(x_edges[0]), float(x_edges[-1]), n_rows - 0.5, -0.5)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#eceff1")
    finite = values[np.isfinite(values)]
    vmin, vmax = (np.percentile(finite, 0.5), np.percentile(finite, 99.9)) if finite.size else (0.0, 1.0)
    if vmax <= vmin:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    im = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest", cmap=cmap,
                   extent=extent, vmin=vmin, vmax=vmax)
    if nonfinite is not None and nonfinite.any():
        ax.imshow(np.ma.masked_where(~nonfinite, np.ones_like(values)), aspect="auto",
                  interpolation="nearest", cmap=ListedColormap([NONFINITE_COLOR]), extent=extent,
                  vmin=0, vmax=1)
        ax.plot([], [], "s", color=NONFINITE_COLOR, label="NaN/Inf")
    if zero is not None and zero.any():
        ax.imshow(np.ma.masked_where(~zero, np.ones_like(values)), aspect="auto", interpolation="nearest",
                  cmap=ListedColormap([ZERO_COLOR]), extent=extent, vmin=0, vmax=1)
        ax.plot([], [], "s", color=ZERO_COLOR, label="exactly 0")
    if empty_label and (~np.isfinite(values) & ~(nonfinite if nonfinite is not None else False)
                        & ~(zero if zero is not None else False)).any():
        ax.plot([], [], "s", color="#eceff1", markeredgecolor="#b0bec5", label=empty_label)
    cbar = ax.figure.colorbar(im, ax=ax, pad=0.01, fraction=0.04)
    cbar.set_label(cbar_label)
    ax.grid(False)
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels([_label(r, 34) for r in row_labels], fontsize=6 if n_rows > 24 else 7)
    for step, severity, *_ in marks:
        ax.axvline(step, color=SEVERITY_COLORS.get(severity, "gray"), ls=":", lw=1.4)
    ax.set_xlim(extent[0], extent[1])
    ax.set_xlabel("step")
    _step_ticks(ax)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, borderaxespad=0.2,
                  ncol=3, fontsize=7)


def plot_profile(names: Sequence[str], values: np.ndarray, groups: Sequence[str], ax, *,
                 ylabel: str, hlines=(), group_colors: dict[str, str] | None = None) -> None:
    """One bar per layer in definition order (log scale), coloured by group ("early", "late", ...)."""
    colors = group_colors or {}
    x = np.arange(len(names))
    v = _positive_or_nan(np.asarray(values, dtype=np.float64))
    seen = set()
    for g in dict.fromkeys(groups):
        sel = np.array([gg == g for gg in groups])
        ax.bar(x[sel], np.nan_to_num(v[sel], nan=0.0), color=colors.get(g, "#90a4ae"),
               label=g if g not in seen else None, width=0.8)
        seen.add(g)
    if np.isfinite(v).any():
        ax.set_yscale("log")
    for y, label, color, style in hlines:
        if y > 0:
            ax.axhline(y, color=color, ls=style, lw=1.1, label=_label(label))
    ax.set_xlim(-0.6, len(names) - 0.4)
    if len(names) <= 40:
        ax.set_xticks(x)
        ax.set_xticklabels([_label(n, 28) for n in names], rotation=60, ha="right", fontsize=6.5)
    else:
        ax.set_xlabel("weight tensor, in definition order (index)")
    ax.set_ylabel(ylabel)
    ax.grid(axis="x", visible=False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)
