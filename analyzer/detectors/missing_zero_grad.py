"""missing_zero_grad: the gradients are never cleared, so each optimizer step applies the sum of
every batch's gradient since the start of training.

``loss.backward()`` adds into ``.grad``; only ``zero_grad()`` clears it. Without it the gradient
of step t is g_1 + ... + g_t: its norm grows step over step (roughly linearly while the batches'
gradients agree), the updates grow with it, and the loss stalls or climbs for no reason the loss
itself shows. Intended gradient accumulation clears the gradients after each optimizer step:
every step starts from new gradient tensors.

The recorder sees which: ``steps/grads_kept`` is 1 when an optimizer step used the very gradient
tensors of the step before (never set to None between them). ``zero_grad(set_to_none=False)``
also keeps them (zeroed in place); the norms tell the two apart. After the last step whose
gradients were new (the first step, or a step that did clear them), a sum grows: t batch
gradients that agree add up to t times one, and the norm rises step over step; cleared in place,
the norm stays at one batch's. Reported (error) when the gradients were kept on at least
``kept_share`` of the optimizer steps after the first, and in a run of ``window`` kept steps after
new ones the norm rose (Spearman's rank correlation with the step at least ``rank_correlation``)
to a median of at least ``growth`` times the new gradients' norm over the run's second half, and
never past what a sum of that many can reach (``window`` + 1 times, doubled for noise): gradients
exploding for another reason in a loop that zeroes in place grow faster than a sum.
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
    # a loop without zero_grad() keeps them on every step (one that clears every 100 steps: 99%).
    kept_share: float = 0.9
    # The kept steps after new gradients that are judged; their norm against the new gradients':
    # a sum of t agreeing gradients is t times one (3x by step 3), of independent ones sqrt(t) (3x
    # by step 9); a trained model's gradient norm falls or stays level from one step to the next.
    window: int = 8
    growth: float = 3.0
    rank_correlation: float = 0.8

    def __post_init__(self):
        _check(self, kept_share=(0.0, 1.0), window=(3, None), growth=(1.0, None), rank_correlation=(-1.0, 1.0))


class Evidence(BaseEvidence, total=False):
    optimizer_steps: int  # optimizer steps judged (steps/grads_kept 0 or 1)
    kept_steps: int  # of those after the first, the ones that used the previous step's gradients
    kept_share: float  # their share (0..1)
    new_gradient_step: int  # the step whose gradients were new, the sum's start
    new_gradient_norm: float  # ... their norm
    grad_norms: list  # the norms of the `window` kept steps after it
    growth: float  # the median over the window's second half / new_gradient_norm
    rank_correlation: float  # Spearman's rank correlation of the window's norms with the step
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
    if len(judged) < cfg.window + 1:
        return []
    after = kept[judged[1:]]
    share = float((after == 1).mean())
    if share < cfg.kept_share:
        return []
    norm = np.asarray(rt.digest.total_grad_norm, dtype=np.float64)[judged]
    k = kept[judged]
    for r in range(len(judged) - cfg.window):  # each run of kept steps after new gradients
        if k[r] != 0 or not (k[r + 1:r + 1 + cfg.window] == 1).all() or not norm[r] > 0:
            continue
        window = norm[r + 1:r + 1 + cfg.window]
        if not np.isfinite(window).all():
            continue
        ratio = window / norm[r]
        growth = float(np.median(ratio[cfg.window // 2:]))
        rho = _spearman(np.arange(cfg.window, dtype=float), window)
        if growth >= cfg.growth and rho >= cfg.rank_correlation and ratio.max() <= 2 * (cfg.window + 1):
            return [_finding(rt, judged, r, window, growth, rho, share, (after == 1).sum(), norm[r], cfg)]
    return []


def _finding(rt, judged, r, window, growth, rho, share, n_kept, new_norm, cfg) -> Finding:
    step = int(rt.step_index[judged[r + 1]])  # the first step that applied earlier gradients again
    ev: Evidence = {"optimizer_steps": int(len(judged)), "kept_steps": int(n_kept), "kept_share": share,
                    "new_gradient_step": int(rt.step_index[judged[r]]), "new_gradient_norm": float(new_norm),
                    "grad_norms": [float(v) for v in window], "growth": growth, "rank_correlation": rho,
                    "threshold_growth": cfg.growth, "threshold_kept_share": cfg.kept_share}
    summary = (f"The gradients are never cleared: {share:.0%} of the optimizer steps used the gradient tensors of "
               f"the step before, and from step {step:,} their norm rose as a sum does, to {growth:.3g}x the "
               f"{new_norm:.3g} of the new gradients of step {ev['new_gradient_step']:,} within {cfg.window} steps: each "
               "step applies the sum of every gradient so far. zero_grad() is missing.")
    return Finding(KIND, "error", step, [], summary, ev, ADVICE)


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])
