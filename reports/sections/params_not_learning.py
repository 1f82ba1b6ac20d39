"""params_not_learning: each parameter's weight norm relative to its first measurement, on the
steps that measured it: the ones the finding names stay on zero while the trained ones move."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import params_not_learning
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import names, text

KIND = "params_not_learning"
CAUSES = {"not_in_optimizer": "are in no optimizer", "unused": "are never used in forward",
          "detached": "get no gradient (detached)", "not_used": "are not used by the forward",
          "zero_gradient": "get a zero gradient",
          "frozen_in_optimizer": "are frozen"}
OTHERS = 6  # trained parameters drawn beside the named ones


def phrase(fs: list[Finding]) -> Text:
    ev: params_not_learning.Evidence = fs[0].evidence
    return text(names(fs[0].where), f" never learn: they {CAUSES.get(ev.get('cause'), 'never change')}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Weight norms against their first value", f.rank)
    ev: params_not_learning.Evidence = f.evidence
    index = {n: i for i, n in enumerate(rt.param_names)}
    named = [index[p] for p in ev.get("params", [])[:plots.MAX_LINES - OTHERS] if p in index]
    if not named:
        return no_figure(title, "The parameters named are not in this rank's trace.")
    steps, rows = [], []
    for a, block in rt.blocks("params/param_norm"):
        measured = (block >= 0).all(axis=1)
        steps.extend((rt.step_index[a:a + len(block)])[measured].tolist())
        rows.extend(block[measured])
    if len(rows) < 2:
        return no_figure(title, "Fewer than two steps measured the weights (watched steps: activations_every).")
    norms = np.asarray(rows, dtype=np.float64)
    change = norms / np.where(norms[0] > 0, norms[0], np.nan) - 1.0
    # (a parameter whose first norm is 0 has only NaN changes: ranked last, with no numpy warning)
    moved = np.max(np.where(np.isnan(change), -np.inf, np.abs(change)), axis=0)
    others = [i for i in np.argsort(-np.nan_to_num(moved), kind="stable") if i not in set(named)][:OTHERS]
    x = np.asarray(steps, dtype=float)
    lines = [plots.Line(rt.param_names[i], x, change[:, i], emphasis=True) for i in named]
    lines += [plots.Line(rt.param_names[i], x, change[:, i]) for i in others]
    caption = ("Each parameter's weight norm on the steps that measured it, as a change from its first "
               "measurement (0: unchanged). Thick: the parameters this finding names, which never move; "
               "thin: the trained parameters that moved most.")
    if ev.get("n_params", 0) > len(named):
        caption += f" {ev['n_params'] - len(named):,} more named parameters are not drawn."
    return figure(title, caption, plots.plot_lines, lines, ylabel="||w|| / ||w_first|| - 1",
                  xspan=ctx.span(rt))
