"""straggler: the slow rank's own work per step against the other ranks', and the others' wait."""

from __future__ import annotations

import warnings

import numpy as np

from ...analyzer.cross_rank import straggler
from ...analyzer.cross_rank.aligned import common_steps, matrix
from ...analyzer.findings import Finding
from ...analyzer.trace.phases import SPENT_IN
from .. import plots, ranks
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import num, step, text

KIND = "straggler"


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: straggler.Evidence = f.evidence
    return text(f"rank {f.rank} straggled from {step(f.step)} ({num(ev.get('excess_s'))} s a step more, in "
                f"{SPENT_IN.get(ev.get('phase'), 'its own work')})")


def figure_for(ctx: Context, f: Finding) -> Figure | None:
    title = f"Rank {f.rank}'s steps against the other ranks'"
    ds = ranks.digests(ctx)
    if f.rank not in ds or len(ds) < 2:
        return no_figure(title, "The ranks' step times could not be read.")
    steps = common_steps(ds)
    ms = lambda series: lambda d: np.asarray(series(d), dtype=np.float64) * 1000  # noqa: E731
    own, back = ms(ranks.own_work), ms(lambda d: d.phases["backward"])
    mine, others = {f.rank: ds[f.rank]}, {r: d for r, d in ds.items() if r != f.rank}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (steps no other rank timed: a gap)
        lines = [
            plots.Line(f"rank {f.rank}: own work", steps, matrix(mine, own, steps)[0], emphasis=True, color="#c62828"),
            plots.Line("others: own work (median)", steps, ranks.median_rank(others, own, steps), color="#616161"),
            plots.Line("others: backward (median)", steps, ranks.median_rank(others, back, steps),
                       color="#1565c0", style="--"),
            plots.Line(f"rank {f.rank}: backward", steps, matrix(mine, back, steps)[0], color="#ef9a9a", style=":"),
        ]
    caption = (f"Milliseconds per step (host clock). Solid: own work (waiting for data, between steps, forward), "
               f"rank {f.rank} in red against the median of the others in grey; dashed and dotted: the backward "
               f"and optimizer step, in which data-parallel ranks wait for the slowest in "
               f"the gradient all-reduce. From {step(f.step)} rank {f.rank}'s own work grows and the others' "
               f"backward grows with it: they wait for it.")
    return figure(title, caption, plots.plot_lines, lines, ylabel="ms", marks=ctx.marks(only=f), height_in=3.0)
