"""dead_relu: the share of each activation's units that never fired, window by window. One
figure serves every dead_relu finding of a rank: it shows all the activations they name."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import dead_relu
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import names, num, step, text

KIND = "dead_relu"
SHARED_FIGURE = True


def phrase(fs: list[Finding]) -> Text:
    where = [w for f in fs for w in f.where]
    shares = [_dead_share(f) for f in fs]
    if len(fs) == 1:
        return text(f"{num(100 * shares[0], '.0f')}% of the units of ", names(where),
                    f" were dead from {step(fs[0].step)}")
    return text("most units of ", names(where), f" were dead from {step(min(f.step for f in fs))}")


def _dead_share(f: Finding) -> float | None:
    ev: dead_relu.Evidence = f.evidence
    return ev.get("dead_share")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Dead units per activation", f.rank)
    shares = ctx.dead_shares(rt)
    if shares is None or shares.empty:
        return no_figure(title, "No per-unit activity was recorded.")
    named = {w for g in ctx.findings if g.kind == KIND and g.rank == f.rank for w in g.where}
    mine = [c for c in shares.columns if any(c == w or c.startswith(f"{w or '(model)'} ") for w in named)]
    others = [c for c in shares.columns if c not in mine]
    last = shares[others].ffill().iloc[-1].fillna(-1.0).to_numpy() if others else np.zeros(0)
    others = [others[i] for i in np.argsort(-last, kind="stable")][: max(0, plots.MAX_LINES - len(mine))]
    cols = [c for c in shares.columns if c in set(mine) | set(others)]
    # Each window as a flat segment over the steps it covers: a share holds for the whole window.
    starts = np.asarray(shares.attrs.get("window_starts", shares.index), dtype=float)
    ends = shares.index.to_numpy(dtype=float) + 1
    x = np.column_stack([starts, ends]).ravel()
    lines = [plots.Line(c, x, np.repeat(shares[c].to_numpy(dtype=float), 2), emphasis=c in mine) for c in cols]
    cfg = ctx.cfg.dead_relu
    hlines = [(cfg.warning_share, f"warning ({cfg.warning_share:.0%})", "#ef6c00", "--"),
              (cfg.error_share, f"error ({cfg.error_share:.0%})", "#c62828", "--")]
    window = rt.meta.get("config", {}).get("activity_window", "?")
    which = "the one this finding is about" if len(mine) <= 1 else "the ones the dead_relu findings name"
    caption = (f"For each activation function, the share of its units that never output a positive "
               f"value during a window of {window} steps (a flat segment per window); thick, {which}. "
               f"A unit that never fires gets no gradient. Dotted lines mark the findings' steps.")
    left = len(shares.columns) - len(cols)
    if left > 0:
        caption += f" {left:,} other activations (with fewer dead units) are not drawn."
    return figure(title, caption, plots.plot_lines, lines, ylabel="share of units dead", hlines=hlines,
                  marks=ctx.marks(rt.rank, kind=KIND), xspan=ctx.span(rt), ylim=(-0.03, 1.05))
