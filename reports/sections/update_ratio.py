"""update_ratio: the update-to-weight ratio of each weight tensor over the sampled steps, against
the usual 1e-3 and the threshold crossed."""

from __future__ import annotations

import warnings

import numpy as np

from ...analyzer.detectors import update_ratio
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import names, num, step, text

KIND = "update_ratio"
USUAL = 1e-3


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: update_ratio.Evidence = f.evidence
    med = ev.get("median_ratio_by_parameter") or {}
    first = num(next(iter(med.values()))) if med else "?"
    if ev.get("direction") == "too_small":
        return text("weights ", names(f.where), f" barely moved from {step(f.step)} (update/weight "
                    f"ratio {first}, ~1e-3 is usual)")
    return text("updates were too large for ", names(f.where), f" from {step(f.step)} (update/weight "
                f"ratio {first}, ~1e-3 is usual)")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Update-to-weight ratio per layer", f.rank)
    upd = ctx.updates(rt)
    if upd is None or upd.empty:
        return no_figure(title, "No update ratios were recorded.")
    min_ndim = ctx.cfg.update_ratio.min_ndim
    cols = [n for n, s in zip(rt.param_names, rt.param_shapes) if len(s) >= min_ndim]
    mine = [w for w in f.where if w in upd.columns][: plots.MAX_LINES]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dev = np.abs(np.log10(np.nanmedian(upd[cols].where(upd[cols] > 0).to_numpy(dtype=float), axis=0)) + 3)
    order = [cols[i] for i in np.argsort(-np.nan_to_num(dev, nan=-1.0), kind="stable") if cols[i] not in mine]
    drawn = [c for c in cols if c in set(mine) | set(order[: max(0, plots.MAX_LINES - len(mine))])]
    x = upd.index.to_numpy()
    lines = [plots.Line(c, x, upd[c].to_numpy(dtype=float), emphasis=c in mine, marker="." if len(x) < 60 else None)
             for c in drawn]
    ev: update_ratio.Evidence = f.evidence
    thr = ev.get("threshold")
    hlines = [(USUAL, "usual ~1e-3", "#2e7d32", "--")]
    if isinstance(thr, (int, float)):
        hlines.append((float(thr), f"threshold {thr:g}", "#c62828", "--"))
    caption = (f"||Δw|| / ||w|| of one optimizer step for each weight tensor, at each sampled step, log "
               f"scale; thick, the tensors the finding names (median {num(_first(f))} over steps "
               f"{_window(f)}). The dotted line marks {step(f.step)}.")
    left = len(cols) - len(drawn)
    if left > 0:
        caption += f" {left:,} other weight tensors, closer to 1e-3, are not drawn."
    still = [c for c in mine if not (upd[c].to_numpy(dtype=float) > 0).any()]
    if still:
        caption += (f" Exactly 0 (the weights did not change at all), drawn as triangles on the bottom "
                    f"edge: {', '.join(still[:5])}{' …' if len(still) > 5 else ''}.")
    return figure(title, caption, plots.plot_lines, lines, log=True, ylabel="update / weight",
                  hlines=hlines, marks=ctx.marks(only=f), xspan=ctx.span(rt))


def _first(f: Finding):
    ev: update_ratio.Evidence = f.evidence
    med = ev.get("median_ratio_by_parameter") or {}
    return next(iter(med.values()), None)


def _window(f: Finding) -> str:
    ev: update_ratio.Evidence = f.evidence
    w = ev.get("window_steps") or ["?", "?"]
    return f"{w[0]:,}-{w[-1]:,}" if all(isinstance(v, int) for v in w) else "?"
