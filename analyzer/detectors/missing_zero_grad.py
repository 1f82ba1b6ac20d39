"""missing_zero_grad: the gradients are never cleared, so each optimizer step applies the sum of
every batch's gradient since the start of training.

``loss.backward()`` adds into ``.grad``; only ``zero_grad()`` clears it. Without it the gradient
of step t is g_1 + ... + g_t: its norm grows step over step (roughly linearly while the batches'
gradients agree), the updates grow with it, and the loss stalls or climbs for no reason the loss
itself shows. Intended gradient accumulation clears the gradients after each optimizer step:
every step starts from new gradient tensors.

The recorder sees which: ``steps/grads_kept`` is 1 when an optimizer step used the very gradient
tensors of the step before (never set to None between them). ``zero_grad(set_to_none=False)``
also keeps them (zeroed in place); the norms tell the two apart: cleared in place, they do not
grow. Reported (error) when the gradients were kept on at least ``kept_share`` of the optimizer
steps after the first, over ``min_steps`` steps, and the total gradient norm grew: the median of
the last ``ends`` optimizer steps at least ``growth`` times that of the first ``ends``, rising
step over step (Spearman's rank correlation with the step at least ``rank_correlation``), and not
exponentially (mid-run, at least ``linearity`` of the ends' mean: a sum grows like t or sqrt(t)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class MissingZeroGradConfig:
    # Share of the optimizer steps after the first that used the previous step's gradient tensors:
    # a loop without zero_grad() keeps them on every step.
    kept_share: float = 0.9
    min_steps: int = 6
    # The summed gradient's norm against the first steps': the sum of t batch gradients that agree
    # grows like t, of t independent ones like sqrt(t) (3x by step 9); a trained model's gradient
    # norm falls or stays level.
    growth: float = 3.0
    ends: int = 3
    rank_correlation: float = 0.8
    # A sum grows like t (batches that agree) or sqrt(t): its norm mid-run is about the mean of the
    # ends' (t) or above (sqrt). Gradients exploding for another reason (in place-zeroed ones) grow
    # exponentially: mid-run near the start's. The middle must reach this share of the ends' mean.
    linearity: float = 0.5

    def __post_init__(self):
        _check(self, kept_share=(0.0, 1.0), min_steps=(3, None), growth=(1.0, None), ends=(1, None),
               rank_correlation=(-1.0, 1.0), linearity=(0.0, None))


class Evidence(BaseEvidence, total=False):
    optimizer_steps: int  # optimizer steps judged (steps/grads_kept 0 or 1)
    kept_steps: int  # of those after the first, the ones that used the previous step's gradients
    kept_share: float  # their share (0..1)
    grad_norm_first: float  # median total gradient norm over the first `ends` optimizer steps
    grad_norm_last: float  # ... and over the last `ends`
    growth: float  # grad_norm_last / grad_norm_first
    rank_correlation: float  # Spearman's rank correlation of the norm with the step
    linearity: float  # the median norm mid-run / the mean of grad_norm_first and grad_norm_last
    threshold_growth: float
    threshold_kept_share: float


KIND = "missing_zero_grad"
REQUIRES = ("steps/grads_kept", "steps/optimizer_steps")
CONFIG = MissingZeroGradConfig
ORDER = 16

ADVICE = ("Call optimizer.zero_grad() (or model.zero_grad()) once per optimizer step: backward() adds into "
          ".grad, so without it every step applies the sum of all gradients so far. For gradient accumulation, "
          "clear them after each optimizer.step(), not never.")


def detect(rt: RankTrace, cfg: MissingZeroGradConfig) -> list[Finding]:
    kept = rt.columns["grads_kept"].to_numpy()
    judged = np.flatnonzero((rt.columns["optimizer_steps"].to_numpy() > 0) & (kept >= 0))
    if len(judged) < max(cfg.min_steps, 2 * cfg.ends):
        return []
    after = kept[judged[1:]]
    share = float((after == 1).mean())
    if share < cfg.kept_share:
        return []
    norm = np.asarray(rt.digest.total_grad_norm, dtype=np.float64)[judged]
    finite = np.isfinite(norm)
    if finite.sum() < max(cfg.min_steps, 2 * cfg.ends):
        return []
    norm_f, steps_f = norm[finite], judged[finite]
    first, last = float(np.median(norm_f[:cfg.ends])), float(np.median(norm_f[-cfg.ends:]))
    growth = last / first if first > 0 else (np.inf if last > 0 else 0.0)
    rho = _spearman(steps_f.astype(float), norm_f)
    mid = len(norm_f) // 2
    middle = float(np.median(norm_f[max(0, mid - cfg.ends // 2):mid + cfg.ends - cfg.ends // 2]))
    linear = middle / ((first + last) / 2) if np.isfinite(last) else 0.0
    if growth < cfg.growth or rho < cfg.rank_correlation or linear < cfg.linearity:
        return []
    step = int(rt.step_index[judged[1]])  # the first step that applied a previous step's gradient again
    ev: Evidence = {"optimizer_steps": int(len(judged)), "kept_steps": int((after == 1).sum()),
                    "kept_share": share, "grad_norm_first": first, "grad_norm_last": last, "growth": float(growth),
                    "rank_correlation": float(rho), "linearity": float(linear), "threshold_growth": cfg.growth,
                    "threshold_kept_share": cfg.kept_share}
    summary = (f"The gradients are never cleared: from step {step:,} on, {share:.0%} of the optimizer steps used "
               f"the gradient tensors of the step before, and the gradient norm grew {growth:.3g}x "
               f"({first:.3g} to {last:.3g}, rising step over step): each step applies the sum of every "
               f"gradient so far. zero_grad() is missing.")
    return [Finding(KIND, "error", step, [], summary, ev, ADVICE)]


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])
