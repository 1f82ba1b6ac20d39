"""loss_scale_collapse: AMP's GradScaler keeps skipping steps, its loss scale collapsing.

A GradScaler (fp16) multiplies the loss by its scale before backward; when the scaled gradients
overflow it skips the optimizer step and halves the scale, and it doubles the scale after
`growth_interval` (2,000) clean steps. So a healthy run skips a handful of steps at the start
(the scale falls from 2^16 to what the gradients allow) and one now and then after a growth.
Those skipped steps are the scaler doing its job: their NaN/Inf gradients are never applied
(the trace reader leaves them out of the gradient series and of `nonfinite`).

Judged after the start-up (up to the first step the optimizer took):
- the scale fell below `min_scale`: even unscaled, the gradients overflow fp16 or are NaN;
- `consecutive_skips` skipped steps in a row: halving the scale that often did not help;
- the scale fell `max_drop` times below its highest value: the gradients grew by orders of
  magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Finding
from ..trace import RankTrace


@dataclass(frozen=True)
class LossScaleConfig:
    # torch.amp.GradScaler's defaults: init_scale 2^16, backoff 0.5 per overflow, growth 2x after
    # growth_interval=2000 clean steps. Below a scale of 1 the unscaled gradients overflow fp16
    # (or are NaN) themselves: no scale can help.
    min_scale: float = 1.0
    # After the start-up, one overflow is one halving: 5 in a row means the gradients grew 32x
    # past what fp16 holds within a few steps (healthy fp16 runs of ours skip 1 at a time).
    consecutive_skips: int = 5
    # A fall of 2^10 below the highest scale after the start-up: gradients 1000x larger.
    max_drop: float = 1024.0


KIND = "loss_scale_collapse"
REQUIRES = ("steps/loss_scale", "steps/optimizer_steps")
CONFIG = LossScaleConfig  # its thresholds: a [loss_scale_collapse] table of analyze --config
ORDER = 170  # among findings of one step and stage, the detectors run (and list) in this order

ADVICE = ("The scaled fp16 gradients overflow step after step: find the layer whose gradients grow "
          "(the per-parameter gradient norms, an exploding_gradients finding), lower the learning rate "
          "or lengthen its warm-up, clip the gradient norm after scaler.unscale_(optimizer), or train "
          "in bf16 (float32's range: no GradScaler needed).")


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, stop) of each run of True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def detect(rt: RankTrace, cfg: LossScaleConfig) -> list[Finding]:
    if rt.n_steps == 0:
        return []
    scale = rt.steps["loss_scale"].to_numpy(dtype=np.float64)
    used = np.isfinite(scale)
    if not used.any():
        return []  # no GradScaler (or a trace from before the schedule was recorded)
    skipped = rt.amp_skipped
    stepped = np.flatnonzero(used & ~skipped)
    steps = rt.step_index
    n_startup = int(stepped[0]) if stepped.size else int(used.sum())
    after = np.arange(rt.n_steps) >= n_startup
    runs = [(a, b) for a, b in _runs(skipped & after)]
    longest = max(runs, key=lambda r: r[1] - r[0]) if runs else None
    evidence = {
        "skipped_in_startup": int(skipped[:n_startup].sum()),
        "skipped_after_startup": int((skipped & after).sum()),
        "steps_after_startup": int((used & after).sum()),
        "longest_skipped_run": int(longest[1] - longest[0]) if longest else 0,
        "scale_first": float(scale[used][0]),
        "scale_last": float(scale[used][-1]),
        "scale_min": float(np.nanmin(scale)),
    }
    event = None  # (row where it began, what happened)
    below = np.flatnonzero(used & (scale < cfg.min_scale))
    if below.size:
        i = int(below[0])
        start = next((a for a, b in _runs(skipped) if a <= i < b + 1), i)
        event = (start, f"the loss scale fell to {scale[i]:.3g} at step {int(steps[i])}, below "
                        f"{cfg.min_scale:g}: the gradients overflow fp16 (or are NaN) even unscaled")
    if event is None and longest and longest[1] - longest[0] >= cfg.consecutive_skips:
        a, b = longest
        event = (a, f"the GradScaler skipped {b - a} steps in a row from step {int(steps[a])}, the "
                    f"scale falling from {scale[a - 1] if a else scale[a]:.3g} to {scale[b - 1]:.3g}")
    if event is None and stepped.size:
        peak = int(stepped[np.nanargmax(scale[stepped])]) if np.isfinite(scale[stepped]).any() else None
        if peak is not None:
            later = np.flatnonzero(used & (np.arange(rt.n_steps) > peak) & (scale <= scale[peak] / cfg.max_drop))
            if later.size:
                first_skip = np.flatnonzero(skipped & (np.arange(rt.n_steps) > peak))
                i = int(first_skip[0]) if first_skip.size else int(later[0])
                event = (i, f"the loss scale fell from {scale[peak]:.3g} (step {int(steps[peak])}) to "
                            f"{scale[later[0]]:.3g} by step {int(steps[later[0]])}, "
                            f"{scale[peak] / scale[later[0]]:.3g}x")
    if event is None:
        return []
    i, what = event
    step = int(steps[i])
    evidence["first_step"] = step
    lr = rt.steps["lr"].to_numpy(dtype=np.float64)
    if np.isfinite(lr[i]):
        evidence["lr_at_step"] = float(lr[i])
    summary = (f"AMP's loss scale collapsed from step {step}: {what}; {evidence['skipped_after_startup']} of "
               f"{evidence['steps_after_startup']} steps after the start-up were skipped, their updates lost.")
    # Below min_scale the run no longer learns from most steps: an error, not a warning.
    severity = "error" if below.size else "warning"
    return [Finding(KIND, severity, step, [], summary, evidence, ADVICE)]
