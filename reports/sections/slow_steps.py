"""slow_steps: the time of every step by phase, the line a step must cross to count as slow, and
the slowest steps marked."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import slow_steps
from ...analyzer.findings import Finding
from ..context import Context
from ..model import Figure, Text
from ._step_time import phase_list, step_time_figure
from ._text import step, text

KIND = "slow_steps"


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: slow_steps.Evidence = f.evidence
    n = ev.get("slow_steps")
    return text(f"{n if n is not None else 'some'} step(s) were slow, the slowest at {step(f.step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    ev: slow_steps.Evidence = f.evidence
    median = ev.get("median_step_s")
    ratio = ctx.cfg.slow_steps.ratio
    hlines = ([(median * 1e3, "median step", "#37474f", "--"),
               (ratio * median * 1e3, f"slow: {ratio:g}x the median", "#c62828", "--")]
              if isinstance(median, (int, float)) else [])
    slowest = [d for d in ev.get("slowest", []) if isinstance(d, dict) and "step" in d and "step_s" in d]
    points = (np.array([d["step"] for d in slowest], dtype=float),
              np.array([d["step_s"] * 1e3 for d in slowest], dtype=float))
    caption = (f"Time of each step (host clock) split into the phases the recorder times ({phase_list()}), "
               f"stacked, in ms. Crosses: the slowest steps the finding lists; above the red line a step "
               f"counts as slow.")
    # One step 100x the median would flatten every other step against the axis: the axis stops
    # at 4x the slow line, and steps beyond it are drawn on the top edge with their time.
    ymax = None
    if isinstance(median, (int, float)) and median > 0 and len(points[1]) and \
            points[1].max() > 4 * ratio * median * 1e3:
        ymax = 4 * ratio * median * 1e3
        caption += (f" The axis stops at {ymax:,.0f} ms; triangles on its top edge are slower steps, "
                    f"labelled with their time in ms.")
    return step_time_figure(ctx, rt, ctx.title_rank("Step time by phase", f.rank), caption,
                            hlines=hlines, points=points, points_label="slowest steps", ymax=ymax)
