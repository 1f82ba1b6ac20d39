"""dataloader_bottleneck: the time of every step by phase, waiting for data at the bottom."""

from __future__ import annotations

from ...analyzer.detectors import dataloader_bottleneck
from ...analyzer.findings import Finding
from ..context import Context
from ..model import Figure, Text
from ._step_time import phase_list, step_time_figure
from ._text import num, step, text

KIND = "dataloader_bottleneck"


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: dataloader_bottleneck.Evidence = f.evidence
    share = ev.get("data_wait_share")
    pct = f"{num(100 * share, '.0f')}% of each step" if isinstance(share, (int, float)) else "much of each step"
    return text(f"the training waited for its input {pct} from {step(f.step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    ev: dataloader_bottleneck.Evidence = f.evidence
    share = ev.get("data_wait_share")
    caption = (f"Time of each step (host clock) split into the phases the recorder times ({phase_list()}), "
               f"stacked, in ms; the first (orange, at the bottom) holds the wait for the next batch.")
    if isinstance(share, (int, float)):
        caption += f" Waiting for data is {share:.0%} of the median step."
    caption += f" The dotted line marks {step(f.step)}."
    return step_time_figure(ctx, rt, ctx.title_rank("Step time by phase", f.rank), caption,
                            marks=ctx.marks(only=f))
