"""`diff --html`: one self-contained HTML page (CSS inline, figures as inline PNG, no script):
the verdict, A and B overlaid (loss, learning rate, total gradient norm) with the parting step
marked, a layers x steps picture of log10(B / A) of the gradient norms in which the first layer to
part stands out, the setup differences and the findings only one run has. Names from the traces
are autoescaped by the template, as in the analyzer's report."""

from __future__ import annotations

import os

import jinja2
import matplotlib
import numpy as np
from matplotlib.colors import TwoSlopeNorm

from ..analyzer.diff import DiffResult
from ..analyzer.diff.trajectories import common_steps
from .diff_text import _finding_line, _value
from .plots import Line, bucket_edges, plot_lines, png_data_uri, render_png, shorten

HEAT_ROWS = 40  # parameters drawn in the picture (those that part most, in model order)
HEAT_BUCKETS = 300  # step buckets across it
HEAT_RANGE = 2.0  # log10(B / A) drawn from -2 (B 100x below) to +2 (100x above)

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                          autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_ENV.filters["data_uri"] = png_data_uri


def render_diff_html(r: DiffResult, a_dir: str, b_dir: str) -> str:
    marks = [(r.parted.step, "error", f"B parts (step {r.parted.step:,})", "D")] if r.parted is not None else []
    figures = [("Loss", render_png(_curves, r, "loss", marks, height_in=2.4)),
               ("Learning rate", render_png(_curves, r, "lr", marks, height_in=2.0)),
               ("Total gradient norm", render_png(_curves, r, "grad", marks, height_in=2.4))]
    heat = _heat(r)
    if heat is not None:
        figures.append(("Gradient norm of each parameter, log10(B / A) over steps (red: B above A, blue: below; "
                        "grey: not finite, or not recorded, in one of them)",
                        render_png(_draw_heat, *heat, marks, height_in=min(7.0, 1.2 + 0.14 * len(heat[1])))))
    setup = [(s["name"], _value(s["a"]), _value(s["b"])) for s in r.setup]
    new = {k: [_finding_line(f) + ": " + f.summary for f in r.new_findings.get(k, [])] for k in ("a", "b")}
    return _ENV.get_template("diff.html.j2").render(
        a_dir=a_dir, b_dir=b_dir, a_rank=r.a.rank, b_rank=r.b.rank, a_steps=r.a.n_steps, b_steps=r.b.n_steps,
        verdict=r.verdict(), parted=r.parted is not None, identical=r.identical, figures=figures, setup=setup,
        new_a=new["a"], new_b=new["b"])


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
    ax.set_yticklabels([shorten(n, 36).replace("$", r"\$") for n in names], fontsize=6)
    ax.grid(False)
    for step, _, _, _ in marks:
        ax.axvline(step, color="black", ls=":", lw=1.2)
    ax.set_xlabel("step")
    ax.figure.colorbar(im, ax=ax, label="log10(B / A)", shrink=0.8)
