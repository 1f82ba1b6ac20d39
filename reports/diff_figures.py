"""`diff`'s figures, drawn once as PNG and placed by both of its documents (diff_report.py's HTML,
diff_pdf.py's PDF): A and B overlaid (loss, learning rate, total gradient norm) with the parting
step marked, and a layers x steps picture of log10(B / A) of the gradient norms in which the first
layer to part stands out."""

from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.colors import TwoSlopeNorm

from ..analyzer.diff import DiffResult
from ..analyzer.diff.trajectories import common_steps
from .context import figure, no_figure
from .model import Figure
from .plots import Line, bucket_edges, plot_lines, shorten

HEAT_ROWS = 40  # parameters drawn in the picture (those that part most, in model order)
HEAT_BUCKETS = 300  # step buckets across it
HEAT_RANGE = 2.0  # log10(B / A) drawn from -2 (B 100x below) to +2 (100x above)


def diff_figures(r: DiffResult) -> list[Figure]:
    """The overlays of loss, learning rate and total gradient norm, then the per-parameter
    picture (when both runs hold a parameter and two common steps)."""
    marks = [(r.parted.step, "error", f"B parts (step {r.parted.step:,})", "D")] if r.parted is not None else []
    where = f" The dotted line is step {r.parted.step:,}, where B parts from A." if r.parted is not None else ""
    both = "A (reference) and B (suspect) over the steps both recorded."
    figures = [figure("Loss", both + where, _curves, r, "loss", marks, height_in=2.4),
                figure("Learning rate", both + where, _curves, r, "lr", marks, height_in=2.0),
                figure("Total gradient norm", both + where, _curves, r, "grad", marks, height_in=2.4)]
    title = "Gradient norm of each parameter, log10(B / A) over steps"
    try:
        heat = _heat(r)
    except Exception as e:  # a bug in the picture's data must not lose the rest of the report
        return figures + [no_figure(title, f"This figure could not be drawn ({type(e).__name__}: {e}).")]
    if heat is not None:
        n = len(heat[1])
        which = (f"The {n} parameters that part most" if n == HEAT_ROWS else "Each parameter both runs hold")
        figures.append(figure(title, f"Red: B above A, blue: below; grey: not finite, or not recorded, in one of "
                                     f"them. {which}, in model order.{where}",
                              _draw_heat, *heat, marks, height_in=min(7.0, 1.2 + 0.14 * n)))
    return figures


def _series(r: DiffResult, which: str):
    steps, ia, ib = common_steps(r.a, r.b)
    out = []
    for rt, rows, label, color in ((r.a, ia, "A (reference)", "#455a64"), (r.b, ib, "B (suspect)", "#c62828")):
        if which == "loss":
            y = rt.columns["loss"].to_numpy(dtype=np.float64)[rows]
        elif which == "lr":
            y = rt.columns["lr"].to_numpy(dtype=np.float64)[rows]
        else:
            y = rt.total_grad_norm.to_numpy(dtype=np.float64)[rows]
        out.append(Line(label, steps, y, emphasis=True, color=color, width=1.2))
    return out


def _curves(r: DiffResult, which: str, marks, ax) -> None:
    lines = _series(r, which)
    positive = all(np.nanmin(np.where(np.isfinite(ln.y), ln.y, np.nan)) > 0 for ln in lines
                   if np.isfinite(ln.y).any())
    plot_lines(lines, ax, log=which != "lr" and positive, marks=marks,
               ylabel={"loss": "loss", "lr": "lr", "grad": "norm"}[which])


def _heat(r: DiffResult):
    """(bucket steps, parameter names, buckets x parameters log10(B / A)), or None."""
    steps, ia, ib = common_steps(r.a, r.b)
    pb = {p: k for k, p in enumerate(r.b.param_names)}
    shared = [(k, pb[p]) for k, p in enumerate(r.a.param_names) if p in pb]
    if len(steps) < 2 or not shared:
        return None
    edges = bucket_edges(len(steps), HEAT_BUCKETS)
    # Buckets of common steps, as row ranges of each run (rows run on where the runs hold the same steps).
    ea = np.append(ia[edges[:-1]], ia[-1] + 1)
    eb = np.append(ib[edges[:-1]], ib[-1] + 1)
    va = r.a.bucketed("params/grad_norm", ea, [k for k, _ in shared])["positive_max"]
    vb = r.b.bucketed("params/grad_norm", eb, [j for _, j in shared])["positive_max"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log10(vb / va)
    worst = np.nan_to_num(np.abs(ratio), nan=0.0).max(axis=0)
    keep = np.sort(np.argsort(-worst, kind="stable")[:HEAT_ROWS])
    names = [r.a.param_names[shared[k][0]] for k in keep]
    return steps[edges[:-1]], names, ratio[:, keep]


def _draw_heat(x, names, ratio, marks, ax) -> None:
    span = (x[0], x[-1] + (x[-1] - x[0]) / max(len(x) - 1, 1))
    im = ax.imshow(np.clip(ratio.T, -HEAT_RANGE, HEAT_RANGE), aspect="auto", interpolation="nearest",
                   cmap=matplotlib.colormaps["RdBu_r"].with_extremes(bad="#bdbdbd"), norm=TwoSlopeNorm(0.0, -HEAT_RANGE, HEAT_RANGE),
                   extent=(span[0], span[1], len(names) - 0.5, -0.5))
    ax.set_yticks(range(len(names)))
    # plots.shorten escapes "$" already (a second escape would print a backslash before it).
    ax.set_yticklabels([shorten(n, 36) for n in names], fontsize=6)
    ax.grid(False)
    for step, _, _, _ in marks:
        ax.axvline(step, color="black", ls=":", lw=1.2)
    ax.set_xlabel("step")
    ax.figure.colorbar(im, ax=ax, label="log10(B / A)", shrink=0.8)
