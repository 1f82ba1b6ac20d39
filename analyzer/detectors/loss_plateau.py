"""loss_plateau: the loss stopped improving for a long stretch while gradients still flow.

Heuristic: over the last `tail_frac` of the run (at least `min_tail_steps` steps, all with a
finite loss), compare the median loss of the stretch's last `edge_frac` with that of its first
`edge_frac`. A relative change below `min_improvement` either way is a plateau (a clear rise is
not: loss_divergence judges rises). The plateau is dated from the step after the last one, up to
the judged stretch, whose trailing median (over as many steps) lay outside the plateau's level
+- `min_improvement`.

Severity is always info: a plateau is often fine (the model has fit what it can at this learning
rate), and a healthy run whose loss flattens gets no warning. Not reported when the total
gradient norm over the stretch is zero (vanishing_gradients reports nothing learning). When the
trace holds no gradients the plateau is still reported, without the gradient evidence.

Source: thresholds measured on the sample traces (see LossPlateauConfig); the test is the one
of ReduceLROnPlateau (torch.optim.lr_scheduler, mode "rel" with threshold 1e-4 over `patience`
epochs), made robust to per-step noise by comparing medians of many steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Finding
from ..series import trailing_median
from ..trace import RankTrace
from .loss_divergence import loss_series, no_loss
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class LossPlateauConfig:
    # The judged stretch: the last `tail_frac` of the run, and no verdict when it has fewer than
    # `min_tail_steps` steps (a plateau is a long stretch).
    tail_frac: float = 0.5
    min_tail_steps: int = 50
    # Plateau: the median loss of the stretch's last fifth (`edge_frac`) differs from that of its
    # first fifth by less than this share. healthy_mlp (Adam 1e-3, constant) still improves by
    # 15% over its last half (measured); vanishing_sigmoid, stuck at ln 4, changes by < 1%.
    min_improvement: float = 0.05
    edge_frac: float = 0.2

    def __post_init__(self):
        _check(self, tail_frac=(0.0, 1.0), min_tail_steps=(2, None), min_improvement=(0.0, None),
               edge_frac=(0.0, 0.5))


KIND = "loss_plateau"
REQUIRES = ("steps/loss",)
CONFIG = LossPlateauConfig  # its thresholds: a [loss_plateau] table of analyze --config
ORDER = 120  # among findings of one step and stage, the detectors run (and list) in this order

ADVICE = (
    "A plateau is often fine: the model has fit what it can. If the loss is higher than you "
    "expect: decay the learning rate (a schedule, or ReduceLROnPlateau), or raise it if it was "
    "very low (see the update_ratio finding, if any); give the model more capacity (width, depth); "
    "check the data (shuffled or noisy labels, uninformative features, a target the inputs cannot "
    "predict). A classification loss stuck at ln(number of classes) means the model predicts the "
    "uniform distribution: look for vanishing gradients or dead units."
)


def detect(rt: RankTrace, cfg: LossPlateauConfig) -> list[Finding]:
    missing = no_loss(rt, KIND)
    if missing:
        return missing
    loss, nonfinite = loss_series(rt)
    steps = rt.step_index
    n_tail = int(len(loss) * cfg.tail_frac)
    t0 = len(loss) - n_tail
    if nonfinite[t0:].any():
        return []  # the run blew up: nonfinite / loss_divergence
    tail = loss[t0:][np.isfinite(loss[t0:])]  # steps whose loss was not passed left out
    n_tail = len(tail)
    if n_tail < cfg.min_tail_steps:
        return []
    n_edge = max(1, int(n_tail * cfg.edge_frac))
    before = float(np.median(tail[:n_edge]))
    level = float(np.median(tail[-n_edge:]))
    if before == 0.0:
        return []  # a loss of exactly zero has nothing left to improve
    change = (before - level) / abs(before)  # > 0: improved
    if abs(change) >= cfg.min_improvement:
        return []

    g = rt.total_grad_norm.to_numpy()[t0:]
    g = g[np.isfinite(g)]
    grad_median = float(np.median(g)) if g.size else None
    if grad_median is not None and grad_median == 0.0:
        return []  # nothing learns at all: vanishing_gradients says so

    # Date the plateau: after the last step, up to the judged stretch, whose trailing median (over
    # as many steps as the medians compared above) lay outside the plateau's band.
    tm = trailing_median(loss, n_edge)
    band = abs(level) * cfg.min_improvement
    outside = np.flatnonzero(~(np.abs(tm[n_edge - 1: t0 + 1] - level) <= band))
    s = n_edge - 1 + int(outside[-1]) + 1 if outside.size else 0
    finite = loss[np.isfinite(loss)]
    first = float(np.median(finite[:n_edge]))
    best = float(np.nanmin(tm))
    evidence = {
        "plateau_start_step": int(steps[s]),
        "steps_on_plateau": int(len(loss) - s),
        "loss_level": level,
        "judged_steps": [int(steps[t0]), int(steps[-1])],
        "median_loss_first_part": before,
        "median_loss_last_part": level,
        "relative_improvement": change,
        "threshold_improvement": cfg.min_improvement,
        "start_loss": first,
        "best_smoothed_loss": best,
        "median_total_grad_norm": grad_median,
    }
    since = "from the start" if s < n_edge else f"since step {int(steps[s])}"
    overall = (f"; over the whole run it went from {first:.4g} to {level:.4g}"
               + (f" ({(level - first) / abs(first):+.0%})" if first != 0 else ""))
    grads = (f", while the gradients are not zero (median norm of all of them together, biases included: "
             f"{grad_median:.3g})"
             if grad_median is not None else "")
    summary = (f"The loss has plateaued at {level:.4g} {since} ({len(loss) - s:,} steps): over steps "
               f"{int(steps[t0])}-{int(steps[-1])} it changed by {-change:+.1%}{grads}{overall}.")
    return [Finding(KIND, "info", int(steps[s]), [], summary, evidence, ADVICE)]
