"""slow_steps: the time of every step by phase, the line a step must cross to count as slow, and
the slowest steps marked."""

from __future__ import annotations

import numpy as np

from ...analyzer.findings import Finding
from ..context import Context
from ..model import Figure, Text
from ._step_time import phase_list, step_time_figure
from ._text import step, text

KIND = "slow_steps"


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    n = f.evidence.get("slow_steps")
    return text(f"{n if n is not None else 'some'} step(s) were slow, the slowest at {step(f.step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    ev = f.evidence
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
    return step_time_figure(ctx, rt, ctx.title_rank("Step time by phase", f.rank), caption,
                            hlines=hlines, points=points, points_label="slowest steps")
