"""Where a figure's parts go: margins measured to hold every label, and log-axis tick labels
in plain text. Both stand in for slower matplotlib machinery (constrained layout, mathtext)
that plots.render_png would otherwise run for every figure of a report."""

from __future__ import annotations

import re

from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatterSciNotation
from matplotlib.transforms import Bbox

# Space kept around everything drawn, in inches.
PAD_IN = 0.05


def fit_margins(fig: Figure) -> None:
    """Margins that just hold every label, tick and outside legend, measured in one layout pass.

    Our figures are one row of axes (a twin axis, side panels, a colorbar), whose labels keep
    their size when the row is moved: measured once, they say where the row's edges must go.
    Parts sized by the row (a colorbar's slot) make moving an edge a little inexact: the edges
    are moved again from the axes' positions alone (cheap: no text is measured). matplotlib's
    constrained layout, which also solves grids of any shape, measures every label twice (over a
    quarter of a report's time, benchmarks/README.md). When the labels would leave the axes no room, the
    default margins stay."""
    w, h = fig.get_size_inches()
    drawn = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    area = _axes_area(fig)  # figure fraction
    # Where each edge of the axes' area goes: the labels beyond it end PAD_IN inside the figure.
    want = ((area.x0 * w - drawn.x0 + PAD_IN) / w, 1 - (drawn.x1 - area.x1 * w + PAD_IN) / w,
            (area.y0 * h - drawn.y0 + PAD_IN) / h, 1 - (drawn.y1 - area.y1 * h + PAD_IN) / h)
    if want[1] - want[0] < 0.2 or want[3] - want[2] < 0.2:
        return
    sp = fig.subplotpars
    edges = [sp.left, sp.right, sp.bottom, sp.top]
    for _ in range(4):
        got = (area.x0, area.x1, area.y0, area.y1)
        if max(abs(t - g) for t, g in zip(want, got)) < 1e-4:
            return
        # (The grid's edges may lie beyond the figure's for a while: a shrunk colorbar ends
        # short of its slot's right edge.)
        edges = [e + (t - g) for e, t, g in zip(edges, want, got)]
        if not (edges[0] < edges[1] and edges[2] < edges[3]):
            return
        fig.subplots_adjust(left=edges[0], right=edges[1], bottom=edges[2], top=edges[3])
        area = _axes_area(fig)


def _axes_area(fig: Figure) -> Bbox:
    """The axes' boxes where drawing will place them (a colorbar's box is shrunk to its aspect
    within its slot only then)."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        locator = ax.get_axes_locator()
        ax.apply_aspect(locator(ax, renderer) if locator else None)
    return Bbox.union([ax.get_position() for ax in fig.axes])


_SUPERSCRIPT = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")
_EXPONENT = re.compile(r"\^\{(-?\d+)\}")


class _PlainLogFormatter(LogFormatterSciNotation):
    """The ticks matplotlib labels on a log (or symlog) axis, written 2×10⁻³ in plain text: its
    own $2\\times10^{-3}$ would go through the mathtext parser (pyparsing: slow for a label)."""

    def __call__(self, x, pos=None):
        label = super().__call__(x, pos)
        if not label.startswith("$\\mathdefault{"):
            return label
        body = _EXPONENT.sub(lambda m: m.group(1).translate(_SUPERSCRIPT), label[len("$\\mathdefault{"):-2])
        return body.replace("\\times", "\u00d7").replace("-", "\u2212")


def plain_log_labels(fig: Figure) -> None:
    """Every log-scale axis of ``fig`` labelled by _PlainLogFormatter (the same ticks labelled)."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for get, put in ((axis.get_major_formatter, axis.set_major_formatter),
                             (axis.get_minor_formatter, axis.set_minor_formatter)):
                f = get()
                if isinstance(f, LogFormatterSciNotation) and not isinstance(f, _PlainLogFormatter):
                    put(_PlainLogFormatter(f._base, f.labelOnlyBase, f.minor_thresholds, f._linthresh))
