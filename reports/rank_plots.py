"""The ranks x steps picture: each rank's value at each step against the median rank's, on a
diverging scale, so that the odd rank is the one coloured row (or the one white row)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib
import numpy as np
from matplotlib.colors import ListedColormap

from .plots import NONFINITE_COLOR, SEVERITY_COLORS, _label, _step_ticks

MISSING_COLOR = "#cfd8dc"  # no step recorded there: the rank's trace had ended
LIMIT = 1.0  # the colour scale's ends, log2 of the ratio to the median: half and twice


def plot_rank_heatmap(dev: np.ndarray, nonfinite: np.ndarray, missing: np.ndarray, row_labels: Sequence[str],
                      x_edges: np.ndarray, ax, *, points: Sequence[tuple[int, float, str]] = (),
                      cbar_label: str = "", binary: str = "") -> None:
    """``dev``: rows x step buckets of log2(value / median rank's); ``nonfinite`` cells in red,
    ``missing`` ones grey. ``points``: (row, step, severity) of the findings, a marker each.
    ``binary``: the cells are equal (0) or not (red, this label in the legend); no colour scale."""
    n_rows = dev.shape[0]
    extent = (float(x_edges[0]), float(x_edges[-1]), n_rows - 0.5, -0.5)
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#ffffff")
    shown = np.where(nonfinite | missing, np.nan, dev)
    im = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap=cmap,
                   extent=extent, vmin=-LIMIT, vmax=LIMIT)
    for mask, color, label in ((nonfinite, NONFINITE_COLOR, "NaN/Inf"), (missing, MISSING_COLOR, "not recorded")):
        if mask.any():
            ax.imshow(np.ma.masked_where(~mask, np.ones_like(dev)), aspect="auto", interpolation="nearest",
                      cmap=ListedColormap([color]), extent=extent, vmin=0, vmax=1)
            ax.plot([], [], "s", color=color, label=label)
    for row, step, severity in points:
        ax.plot([step], [row], marker="v", ms=7, color=SEVERITY_COLORS.get(severity, "black"),
                markeredgecolor="black", markeredgewidth=0.6, zorder=5)
    if points:
        ax.plot([], [], "v", color="white", markeredgecolor="black", label="a finding of that rank")
    if binary:
        ax.plot([], [], "s", color=matplotlib.colormaps["RdBu_r"](1.0), label=binary)
    else:
        cbar = ax.figure.colorbar(im, ax=ax, pad=0.01, fraction=0.04, ticks=[-1, -0.5, 0, 0.5, 1])
        cbar.ax.set_yticklabels(["½x", "0.7x", "median", "1.4x", "2x"])
        cbar.set_label(cbar_label, fontsize=7)
    ax.grid(False)
    step = max(1, int(np.ceil(n_rows / 40)))  # at most ~40 labels
    ax.set_yticks(range(0, n_rows, step))
    ax.set_yticklabels([_label(row_labels[i], 16) for i in range(0, n_rows, step)], fontsize=6 if n_rows > 16 else 7)
    ax.set_xlim(extent[0], extent[1])
    ax.set_xlabel("step")
    _step_ticks(ax)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, borderaxespad=0.2, ncol=3, fontsize=7)
