"""loss_zero: the loss is exactly 0.0 on many steps — no learning signal, usually a bug.

A real loss is exactly zero in floating point only when every term of it is: a mask that keeps
nothing (an inverted padding mask, a length check that is never true), targets leaked into the
inputs, or a hand-written -log(softmax(x)) whose softmax rounds to exactly 1 (float32 does so
once the margin passes ~17; F.cross_entropy's log-softmax keeps a tiny, non-zero loss there).
Those steps send (near) zero gradients: the model does not learn from them, and the hand-written
loss that rounds to 0 on confident rows rounds to log(0) = -inf on the first confident mistake.

Reported (warning) when the loss is exactly 0 on at least `min_share` of the first `first_steps`
steps (a model cannot be perfect from its start), or on at least `min_share` of the steps
before the loss first went non-finite (the precursor of that failure). A loss that reaches 0
late in a run that never fails is reported as info: an easy task fit to float precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ..trace.losses import loss_series
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class LossZeroConfig:
    # A loss of exactly 0.0 on this share of the first `first_steps` steps, or of the steps before
    # the loss first went non-finite, is a warning (see detectors/loss_zero.py). Half: a bug
    # zeroes every step (a mask that keeps nothing) or most of them before it breaks.
    min_share: float = 0.5
    first_steps: int = 20

    def __post_init__(self):
        _check(self, min_share=(0.0, 1.0), first_steps=(1, None))


class Evidence(BaseEvidence, total=False):
    zero_loss_steps: int  # steps whose loss was exactly 0.0
    steps: int  # steps recorded
    first_zero_step: int  # the first step with a loss of exactly 0.0
    zero_share_first_steps: float  # share of the first `first_steps` steps with a zero loss (0..1)
    first_steps: int  # how many first steps that share is over
    first_nonfinite_loss_step: int  # the first step whose loss was NaN/Inf (None: none was)
    zero_share_before_failure: float  # share of the steps before it with a zero loss (None: no failure)
    threshold_share: float  # the share judged a warning (min_share, 0..1)


KIND = "loss_zero"
REQUIRES = ("steps/loss",)
CONFIG = LossZeroConfig  # its thresholds: a [loss_zero] table of analyze --config
ORDER = 90  # among findings of one step and stage, the detectors run (and list) in this order

ADVICE = (
    "A loss of exactly 0 carries no gradient. Check the loss's mask or weights (an inverted "
    "padding mask, a length condition that is never true, every target ignored), that the "
    "targets are not derived from the model's own outputs or inputs, and compute log-"
    "probabilities with F.log_softmax / F.cross_entropy rather than torch.log(torch.softmax(x)): "
    "the latter rounds to log(1) = 0 on confident rows and to log(0) = -inf on the first confident "
    "mistake."
)


def detect(rt: RankTrace, cfg: LossZeroConfig) -> list[Finding]:
    loss, real_nan = loss_series(rt)
    zero = loss == 0.0
    if not zero.any():
        return []
    steps = rt.step_index
    bad = np.flatnonzero(real_nan | np.isinf(loss))
    fail = int(bad[0]) if bad.size else None
    n_first = min(cfg.first_steps, len(loss))
    first_share = float(zero[:n_first].mean()) if n_first else 0.0
    before = zero[:fail] if fail is not None else zero
    before_share = float(before.mean()) if len(before) else 0.0
    z = np.flatnonzero(zero)
    evidence = {
        "zero_loss_steps": int(zero.sum()),
        "steps": int(len(loss)),
        "first_zero_step": int(steps[z[0]]),
        "zero_share_first_steps": first_share,
        "first_steps": n_first,
        "first_nonfinite_loss_step": int(steps[fail]) if fail is not None else None,
        "zero_share_before_failure": before_share if fail is not None else None,
        "threshold_share": cfg.min_share,
    }
    if first_share >= cfg.min_share:
        severity = "warning"
        summary = (f"The loss is exactly 0 on {int(zero[:n_first].sum())} of the first {n_first} steps "
                   f"(from step {int(steps[z[0]])}; {int(zero.sum())} of {len(loss)} in all): no learning "
                   f"signal from the start, which a real model cannot earn.")
    elif fail is not None and before_share >= cfg.min_share:
        severity = "warning"
        summary = (f"The loss was exactly 0 on {int(before.sum())} of the {len(before)} steps before it went "
                   f"non-finite at step {int(steps[fail])} (first at step {int(steps[z[0]])}): a loss that "
                   f"rounds to 0 on confident rows and to -inf on a confident mistake.")
    else:
        severity = "info"
        summary = (f"The loss is exactly 0 on {int(zero.sum())} of {len(loss)} steps, first at step "
                   f"{int(steps[z[0]])}: those steps carry no gradient.")
    return [Finding(KIND, severity, int(steps[z[0]]), [], summary, evidence, ADVICE)]
