"""initial_loss: a loss that starts in the wrong place, or never leaves it.

- ``far_from_chance`` (warning): a classifier's first loss far above chance. A freshly
  initialised classifier predicts about uniformly over its C classes, so its cross-entropy starts
  near ln(C) (ln 2 per output for a binary cross-entropy with logits): Karpathy, "A Recipe for
  Training Neural Networks" (2019), "verify loss @ init"; CS231n's "look for correct loss at
  chance performance". Much higher means confident wrong predictions before any training: a
  broken initialisation (a last layer scaled up, logits not scaled down) or labels encoded
  wrong (multi-hot or unnormalised target distributions). Reported when the first step's loss is
  at least ``factor`` x the chance loss and ``margin`` nats above it. Needs the loss function's
  ops (``loss_function/``: a cross-entropy) and the model's output shape (``module_outputs/``:
  C is its last dimension); a run resumed from a checkpoint (first step above 0) is not judged.
- ``never_moved`` (warning): over ``min_steps`` optimizer steps from step 0, the median loss of
  the run's last quarter is within ``still`` (or, if the batches' losses scatter more, within
  ``noise`` standard errors) of where it started, the median of its first ``first_steps`` steps
  (2% of a long run): the "overfit one batch" check
  failed (nothing trains: a learning rate of ~0, gradients that do not reach the weights, labels
  unrelated to the inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ..trace.losses import loss_series
from ._thresholds import check_bounds as _check

CROSS_ENTROPY = ("NllLossBackward0", "NllLoss2DBackward0", "LogSoftmaxBackward0")  # (a hand-written one: log_softmax)
BINARY = ("BinaryCrossEntropyWithLogitsBackward0",)


@dataclass(frozen=True)
class InitialLossConfig:
    factor: float = 2.0  # the first loss at least this many times the chance loss ...
    margin: float = 1.0  # ... and this many nats above it
    min_steps: int = 100  # optimizer steps a run needs before "never moved" is judged
    first_steps: int = 5  # where the loss started: the median of its first steps (at least this many, 2% of the run)
    still: float = 0.01  # the last quarter's median within 1% of the first quarter's ...
    noise: float = 3.0  # ... or within 3 standard errors of the two medians' difference

    def __post_init__(self):
        _check(self, factor=(1.0, None), margin=(0.0, None), min_steps=(8, None), first_steps=(1, None),
               still=(0.0, 1.0), noise=(0.0, None))


class Evidence(BaseEvidence, total=False):
    cause: str  # far_from_chance | never_moved
    initial_loss: float  # the first step's loss (far_from_chance) or the median of the first steps (never_moved)
    chance_loss: float  # far_from_chance: ln(classes), or ln 2 for a binary cross-entropy
    classes: int  # ... C, the model's output's last dimension (2 for binary)
    loss_ops: list  # ... the loss function's autograd ops
    final_loss: float  # never_moved: the median over the run's last quarter
    relative_change: float  # ... (final - initial) / initial
    tolerance: float  # ... the relative change judged still: max(still, noise standard errors)
    optimizer_steps: int  # never_moved: optimizer steps in the run


KIND = "initial_loss"
REQUIRES = ("steps/loss",)
CONFIG = InitialLossConfig
ORDER = 18

ADVICE = {
    "far_from_chance": "At initialisation a classifier should predict about uniformly: its cross-entropy near "
                       "ln(classes). Check the last layer's initialisation (a default init, or zeros for the "
                       "classifier's weights) and the targets (class indices 0..C-1, or distributions that sum to 1).",
    "never_moved": "Nothing trains: check that the optimizer steps the model's parameters with a learning rate above "
                   "0, that gradients reach them, and that the labels belong to their inputs (train on one batch "
                   "until its loss is near 0).",
}


def detect(rt: RankTrace, cfg: InitialLossConfig) -> list[Finding]:
    loss, _ = loss_series(rt)
    steps = rt.step_index
    if not len(loss):
        return []
    out = []
    chance = _chance(rt)
    if chance is not None and int(steps[0]) == 0 and np.isfinite(loss[0]):
        c, expected, ops = chance
        first = float(loss[0])
        if first >= cfg.factor * expected and first - expected >= cfg.margin:
            ev: Evidence = {"cause": "far_from_chance", "initial_loss": first, "chance_loss": expected,
                            "classes": c, "loss_ops": ops}
            out.append(Finding(KIND, "warning", 0, [""],
                               f"The loss started at {first:.4g}, {first / expected:.3g}x the {expected:.3g} of chance "
                               f"(ln {c:,} classes): the model was confidently wrong before it trained.", ev,
                               ADVICE["far_from_chance"]))
    stepped = rt.columns["optimizer_steps"].to_numpy() > 0
    finite = np.isfinite(loss)
    if stepped.sum() >= cfg.min_steps and finite.sum() >= cfg.min_steps and int(steps[0]) == 0:
        ok = loss[finite]
        q, k = len(ok) // 4, max(cfg.first_steps, len(ok) // 50)
        # Where the loss started (its first steps: a loss that falls 7x in its first 20 steps and
        # slowly after that moved, though its first and last quarters are alike) against where it ended.
        start, end = float(np.median(ok[:k])), float(np.median(ok[-q:]))
        # The standard error of a median of n values is ~1.25 sigma / sqrt(n); sigma from the MAD
        # of the steps' differences (a trend does not inflate it).
        sigma = 1.4826 * float(np.median(np.abs(np.diff(ok) - np.median(np.diff(ok))))) / math.sqrt(2)
        tol = max(cfg.still, cfg.noise * 1.25 * sigma * math.sqrt(1 / k + 1 / q) / abs(start)) if start else 0.0
        change = (end - start) / abs(start) if start else math.inf
        if start and abs(change) <= tol:
            ev = {"cause": "never_moved", "initial_loss": start, "final_loss": end, "relative_change": change,
                  "tolerance": tol, "optimizer_steps": int(stepped.sum())}
            out.append(Finding(KIND, "warning", int(steps[np.flatnonzero(finite)[0]]), [""],
                               f"The loss never moved: {start:.4g} over its first {k} steps of {int(stepped.sum()):,} "
                               f"optimizer steps, {end:.4g} over the last quarter ({change:+.2%}, within the batches' "
                               f"noise of {tol:.2%}).", ev, ADVICE["never_moved"]))
    return out


def _chance(rt) -> tuple[int, float, list] | None:
    """(classes, chance loss, the loss's ops) of a classification loss, or None. A model that
    computes its own loss (transformers' with labels=) has it among its outputs: its op is that
    output's grad_fn."""
    ops = rt.loss_function_ops
    if ops is None:
        return None
    t = rt.module_outputs
    root = t[t["module_index"] == 0] if len(t) else t
    made = [str(g) for g in root["grad_fn"]] if len(root) else []
    names = ops or made
    if any(o in BINARY for o in names):
        return 2, math.log(2), names
    if not any(o in CROSS_ENTROPY for o in names):
        return None
    shape = next((s for s in rt.output_shapes(0) if len(s) >= 2), None)
    if shape is None:
        return None
    c = shape[1] if "NllLoss2DBackward0" in names else shape[-1]  # (images: N, C, H, W)
    return (int(c), math.log(c), names) if c >= 2 else None
