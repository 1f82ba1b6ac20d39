"""Where the step time goes: the phases recorded every step (steps/between_steps_s,
forward_s, backward_s, recorder_s), host clock; steps/data_wait_s is the part of between_steps_s
spent in DataLoader.__next__."""

from __future__ import annotations

import numpy as np

from ..trace import RankTrace
from .phases import TIMED


def phases(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """(steps x 4 phase times, total per step) with NaN rows where a phase was not timed."""
    df = rt.columns
    t = np.stack([df[c].to_numpy(dtype=float) for c in TIMED], axis=1)
    return t, t.sum(axis=1)
