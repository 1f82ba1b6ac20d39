"""`diff`'s figures, drawn once as PNG and placed by both of its documents (diff_report.py's HTML,
diff_pdf.py's PDF): A and B overlaid (loss, learning rate, total gradient norm) with the parting
step marked, and layers x steps pictures of log10(B / A) of the gradient norms and of the modules'
outputs (max |x| on the steps both watched) in which the first layer to part stands out."""

from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.colors import TwoSlopeNorm

from ..analyzer.diff import DiffResult
from ..analyzer.diff.trajectories import common_steps
from ..analyzer.trace.format import UNMEASURED_IS_NEGATIVE, measured_rows
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
    for title, table, thing in (("Gradient norm of each parameter, log10(B / A) over steps", "params/grad_norm",
                                 "parameters"),
                                ("Output of each module (max |x|), log10(B / A) over the watched steps",
                                 "modules/output_absmax", "modules")):
        try:
            heat = _heat(r, table)
        except Exception as e:  # a bug in the picture's data must not lose the rest of the report
            figures.append(no_figure(title, f"This figure could not be drawn ({type(e).__name__}: {e})."))
            continue
        if heat is None:
            continue
        n = len(heat[1])
        which = f"The {n} {thing} that part most" if n == HEAT_ROWS else f"Each of the {thing} both runs hold"
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


def _heat(r: DiffResult, table: str):
    """(bucket edges in steps, tensor names, buckets x tensors log10(B / A)) of a steps x
    parameters or steps x modules table, or None where nothing of it is recorded in both. The
    modules' outputs are bucketed over the steps both runs watched (the others hold none)."""
    steps, ia, ib = common_steps(r.a, r.b)
    names = (lambda rt: rt.param_names) if table.startswith("params/") else (lambda rt: rt.module_labels)
    nb = {p: k for k, p in enumerate(names(r.b))}
    shared = [(k, nb[p]) for k, p in enumerate(names(r.a)) if p in nb]
    at = np.arange(len(steps))  # the common steps drawn (positions in `steps`)
    if table in UNMEASURED_IS_NEGATIVE and table.startswith("modules/"):
        at = np.flatnonzero(_measured(r.a, table)[ia] & _measured(r.b, table)[ib])
    if len(at) < 2 or not shared:
        return None
    starts = at[bucket_edges(len(at), HEAT_BUCKETS)[:-1]]
    # Buckets of common steps, as row ranges of each run (rows run on where the runs hold the same steps).
    ea = np.append(ia[starts], ia[at[-1]] + 1)
    eb = np.append(ib[starts], ib[at[-1]] + 1)
    va = r.a.bucketed(table, ea, [k for k, _ in shared])["positive_max"]
    vb = r.b.bucketed(table, eb, [j for _, j in shared])["positive_max"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log10(vb / va)
    if not np.isfinite(ratio).any():
        return None
    worst = np.nan_to_num(np.abs(ratio), nan=0.0, posinf=0.0, neginf=0.0).max(axis=0)
    keep = np.sort(np.argsort(-worst, kind="stable")[:HEAT_ROWS])
    x = np.append(steps[starts], steps[-1] + 1)
    x[0] = steps[0]  # (the first and last buckets reach the ends: every picture spans the same steps)
    return x, [names(r.a)[shared[k][0]] for k in keep], ratio[:, keep]


def _measured(rt, table: str) -> np.ndarray:
    """Which rows of the table were measured (watched steps), read a block at a time."""
    parts = [measured_rows(block) for _, block in rt.blocks(table)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _draw_heat(x, names, ratio, marks, ax) -> None:
    im = ax.pcolormesh(x, np.arange(len(names) + 1) - 0.5, np.ma.masked_invalid(np.clip(ratio.T, -HEAT_RANGE, HEAT_RANGE)),
                       cmap=matplotlib.colormaps["RdBu_r"].with_extremes(bad="#bdbdbd"),
                       norm=TwoSlopeNorm(0.0, -HEAT_RANGE, HEAT_RANGE), shading="flat")
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_yticks(range(len(names)))
    # plots.shorten escapes "$" already (a second escape would print a backslash before it).
    ax.set_yticklabels([shorten(n, 36) for n in names], fontsize=6)
    ax.grid(False)
    for step, _, _, _ in marks:
        ax.axvline(step, color="black", ls=":", lw=1.2)
    ax.set_xlabel("step")
    ax.figure.colorbar(im, ax=ax, label="log10(B / A)", shrink=0.8)
