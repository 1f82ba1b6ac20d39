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

from ..findings import Evidence as BaseEvidence, Finding
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


class Evidence(BaseEvidence, total=False):
    skipped_in_startup: int  # steps the GradScaler skipped before the optimizer first stepped
    skipped_after_startup: int  # ... and after that
    steps_after_startup: int  # steps with a loss scale after the start-up
    longest_skipped_run: int  # the most steps skipped in a row after the start-up
    scale_first: float  # the loss scale on the first step that had one
    scale_last: float  # ... on the last
    scale_min: float  # its lowest
    first_step: int  # the step the collapse is dated from
    lr_at_step: float  # the learning rate on that step, if recorded


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
    h = _history(rt)
    c = _collapse(h, cfg) if h is not None else None
    if c is None:
        return []
    steps = rt.step_index
    step = int(steps[c.row])
    evidence = _evidence(h)
    evidence["first_step"] = step
    lr = rt.columns["lr"].to_numpy(dtype=np.float64)
    if np.isfinite(lr[c.row]):
        evidence["lr_at_step"] = float(lr[c.row])
    summary = (f"AMP's loss scale collapsed from step {step}: {_what(c, h.scale, steps, cfg)}; "
               f"{evidence['skipped_after_startup']} of {evidence['steps_after_startup']} steps after the "
               f"start-up were skipped, their updates lost.")
    # Below min_scale the run no longer learns from most steps: an error, not a warning.
    severity = "error" if c.test == "below_min" else "warning"
    return [Finding(KIND, severity, step, [], summary, evidence, ADVICE)]


@dataclass(frozen=True)
class _ScaleHistory:
    """The GradScaler's loss scale and skipped steps, per row of the trace."""

    scale: np.ndarray  # the loss scale (NaN: no GradScaler on that step)
    used: np.ndarray  # rows with a loss scale
    skipped: np.ndarray  # rows the scaler skipped (no optimizer step)
    stepped: np.ndarray  # the rows the optimizer stepped on
    after: np.ndarray  # rows after the start-up
    n_startup: int  # the start-up's rows: up to the first step the optimizer took
    longest: tuple[int, int] | None  # (start, stop) of the longest run of skips after the start-up


@dataclass(frozen=True)
class _Collapse:
    """The first sign of a collapse found (test), the row it is dated from, and the rows it quotes:
    below_min: the scale fell below min_scale at ``at`` (row: the start of the skips it ended);
    skips: rows row..at-1 all skipped; drop: the scale fell from its peak at ``peak`` to ``at``."""

    test: str  # "below_min" | "skips" | "drop"
    row: int
    at: int
    peak: int = -1


def _history(rt: RankTrace) -> _ScaleHistory | None:
    if rt.n_steps == 0:
        return None
    scale = rt.columns["loss_scale"].to_numpy(dtype=np.float64)
    used = np.isfinite(scale)
    if not used.any():
        return None  # no GradScaler (or a trace from before the schedule was recorded)
    skipped = rt.amp_skipped
    stepped = np.flatnonzero(used & ~skipped)
    n_startup = int(stepped[0]) if stepped.size else int(used.sum())
    after = np.arange(rt.n_steps) >= n_startup
    runs = _runs(skipped & after)
    longest = max(runs, key=lambda r: r[1] - r[0]) if runs else None
    return _ScaleHistory(scale, used, skipped, stepped, after, n_startup, longest)


def _evidence(h: _ScaleHistory) -> Evidence:
    return {
        "skipped_in_startup": int(h.skipped[:h.n_startup].sum()),
        "skipped_after_startup": int((h.skipped & h.after).sum()),
        "steps_after_startup": int((h.used & h.after).sum()),
        "longest_skipped_run": int(h.longest[1] - h.longest[0]) if h.longest else 0,
        "scale_first": float(h.scale[h.used][0]),
        "scale_last": float(h.scale[h.used][-1]),
        "scale_min": float(np.nanmin(h.scale)),
    }


def _collapse(h: _ScaleHistory, cfg: LossScaleConfig) -> _Collapse | None:
    """The first of the three tests (module docstring) that finds a collapse, or None."""
    scale, used, skipped = h.scale, h.used, h.skipped
    below = np.flatnonzero(used & (scale < cfg.min_scale))
    if below.size:
        i = int(below[0])
        return _Collapse("below_min", next((a for a, b in _runs(skipped) if a <= i < b + 1), i), i)
    if h.longest and h.longest[1] - h.longest[0] >= cfg.consecutive_skips:
        return _Collapse("skips", *h.longest)
    if not h.stepped.size or not np.isfinite(scale[h.stepped]).any():
        return None
    peak = int(h.stepped[np.nanargmax(scale[h.stepped])])
    rows = np.arange(len(scale))
    later = np.flatnonzero(used & (rows > peak) & (scale <= scale[peak] / cfg.max_drop))
    if not later.size:
        return None
    # Dated from the first skip after the peak: the fall is a run of halvings.
    first_skip = np.flatnonzero(skipped & (rows > peak))
    return _Collapse("drop", int(first_skip[0]) if first_skip.size else int(later[0]), int(later[0]), peak)


def _what(c: _Collapse, scale: np.ndarray, steps: np.ndarray, cfg: LossScaleConfig) -> str:
    i = c.at
    if c.test == "below_min":
        return (f"the loss scale fell to {scale[i]:.3g} at step {int(steps[i])}, below "
                f"{cfg.min_scale:g}: the gradients overflow fp16 (or are NaN) even unscaled")
    if c.test == "skips":
        a, b = c.row, c.at
        return (f"the GradScaler skipped {b - a} steps in a row from step {int(steps[a])}, the "
                f"scale falling from {scale[a - 1] if a else scale[a]:.3g} to {scale[b - 1]:.3g}")
    return (f"the loss scale fell from {scale[c.peak]:.3g} (step {int(steps[c.peak])}) to "
            f"{scale[i]:.3g} by step {int(steps[i])}, {scale[c.peak] / scale[i]:.3g}x")
