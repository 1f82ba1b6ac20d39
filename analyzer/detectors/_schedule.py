"""What the learning rate did around a finding's step: the first thing an engineer checks next
to an explosion ("did it blow up when the warm-up ended?", "did the lr spike?")."""

from __future__ import annotations

import numpy as np

from ..findings import Evidence
from ..trace import RankTrace


class LrEvidence(Evidence, total=False):
    """What lr_context adds to a finding's evidence."""

    lr_at_step: float  # the learning rate at the finding's step
    lr_first: float  # ... at the first step that had one
    lr_peak_before: float  # its highest up to the finding's step
    lr_spike_ratio: float  # the lr at the step over its median of the steps before, when it spiked
    warmup_end_step: int  # the step a warm-up reached its peak, when there was one

# A warm-up: the lr rose at least this many times from the first step to its peak.
WARMUP_RISE = 2.0
# An event "began when the warm-up ended": within one warm-up length (at least NEAR_STEPS) after
# the lr stopped rising. An instability a higher lr sets off takes a while to grow: in
# tests/analyzer/test_lr_in_findings.py's run the gradients explode 12 steps after a 20-step warm-up.
NEAR_STEPS = 10
# A spike: the lr at the step is this many times its median over the SPIKE_WINDOW steps before.
SPIKE_RATIO, SPIKE_WINDOW = 3.0, 50


def lr_context(rt: RankTrace, row: int) -> tuple[dict, str]:
    """(evidence, a clause for the summary or "") about the learning rate up to ``row``."""
    whole = rt.columns["lr"].to_numpy(dtype=np.float64)
    lr = whole[: row + 1]
    ok = np.flatnonzero(np.isfinite(lr))
    if not ok.size or not np.isfinite(lr[row]):
        return {}, ""
    steps = rt.step_index
    evidence = {"lr_at_step": float(lr[row]), "lr_first": float(lr[ok[0]])}
    peak = int(ok[np.argmax(lr[ok])])
    evidence["lr_peak_before"] = float(lr[peak])
    before = lr[max(0, row - SPIKE_WINDOW):row]
    before = before[np.isfinite(before)]
    if before.size and np.median(before) > 0 and lr[row] >= SPIKE_RATIO * np.median(before):
        evidence["lr_spike_ratio"] = float(lr[row] / np.median(before))
        return evidence, (f"after the learning rate jumped to {lr[row]:.3g} ({evidence['lr_spike_ratio']:.3g}x "
                          f"its median over the {before.size} steps before)")
    first = lr[ok[0]]
    every = np.flatnonzero(np.isfinite(whole))
    top = float(whole[every].max())
    if first > 0 and top >= WARMUP_RISE * first:
        # The warm-up (over the whole run) ended at the first step the lr reached its peak (1%).
        end = int(every[np.flatnonzero(whole[every] >= 0.99 * top)[0]])
        evidence["warmup_end_step"] = int(steps[end])
        if row < end:
            return evidence, (f"while the learning rate was still warming up ({lr[row]:.3g}, rising from "
                              f"{first:.3g} to {top:.3g} at step {int(steps[end])})")
        after = int(steps[row] - steps[end])
        if after <= max(NEAR_STEPS, int(steps[end] - steps[every[0]])):
            return evidence, (f"{after} steps after the learning-rate warm-up ended at step {int(steps[end])} "
                              f"(lr {first:.3g} -> {top:.3g})")
    return evidence, ""
