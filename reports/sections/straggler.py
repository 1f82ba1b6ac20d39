"""straggler: the slow rank's own work per step against the other ranks', and the others' wait."""

from __future__ import annotations

import numpy as np

from ...analyzer.cross_rank import straggler
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
    others = {r: d for r, d in ds.items() if r != f.rank}
    ms = lambda xy: (xy[0], np.asarray(xy[1], dtype=np.float64) * 1000)  # noqa: E731
    own, back = ranks.bucket_lines(others, "own", [], median_label="m"), ranks.bucket_lines(others, "backward", [], median_label="m")
    mine_own = ranks.bucket_lines({f.rank: ds[f.rank]}, "own", [f.rank])
    mine_back = ranks.bucket_lines({f.rank: ds[f.rank]}, "backward", [f.rank])
    if not (own and back and mine_own and mine_back):
        return no_figure(title, "The ranks' step times could not be read.")
    line = lambda label, xy, **kw: plots.Line(label, *ms(xy), **kw)  # noqa: E731
    lines = [
        line(f"rank {f.rank}: own work", mine_own[f"rank {f.rank}"], emphasis=True, color="#c62828"),
        line("others: own work (median)", own["m"], color="#616161"),
        line("others: backward (median)", back["m"], color="#1565c0", style="--"),
        line(f"rank {f.rank}: backward", mine_back[f"rank {f.rank}"], color="#ef9a9a", style=":"),
    ]
    caption = (f"Milliseconds per step (host clock; each point the mean of a bucket of steps). Solid: own work (waiting for data, between steps, forward), "
               f"rank {f.rank} in red against the median of the others in grey; dashed and dotted: the backward "
               f"and optimizer step, in which data-parallel ranks wait for the slowest in "
               f"the gradient all-reduce. From {step(f.step)} rank {f.rank}'s own work grows and the others' "
               f"backward grows with it: they wait for it.")
    return figure(title, caption, plots.plot_lines, lines, ylabel="ms", marks=ctx.marks(only=f), height_in=3.0)
