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

from ..findings import Evidence as BaseEvidence, Finding
from ..series import trailing_median
from ..trace import RankTrace
from ..trace.losses import loss_series
from .loss_divergence import no_loss
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


class Evidence(BaseEvidence, total=False):
    plateau_start_step: int  # the first step of the plateau
    steps_on_plateau: int  # the steps from it to the end of the run
    loss_level: float  # the plateau's level: the median loss of the judged stretch's last edge_frac
    judged_steps: list  # [first, last] step of the judged stretch (the run's last tail_frac)
    median_loss_first_part: float  # the median loss of the stretch's first edge_frac
    median_loss_last_part: float  # ... of its last edge_frac (= loss_level)
    relative_improvement: float  # (first part - last part) / |first part|: > 0 improved (a share)
    threshold_improvement: float  # the change below which it is a plateau (min_improvement, a share)
    start_loss: float  # the median loss of the run's first steps (as many as each part)
    best_smoothed_loss: float  # the lowest trailing median of the loss over the run
    median_total_grad_norm: float  # the median L2 norm of all gradients over the stretch (None: none recorded)
    steps: int  # (not checked: no loss was given) the steps the trace holds


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
    p = _measure(rt, loss, nonfinite, cfg)
    if p is None:
        return []
    steps = rt.step_index
    return [Finding(KIND, "info", int(steps[p.start]), [], _summary(p, steps, len(loss)),
                    _evidence(p, steps, len(loss), cfg), ADVICE)]


@dataclass(frozen=True)
class _Plateau:
    """A loss that stopped improving: the judged stretch's numbers (rows index the steps)."""

    t0: int  # the judged stretch's first row
    n_edge: int  # the steps in each median compared
    before: float  # the median loss of the stretch's first part
    level: float  # ... of its last part: the plateau's level
    change: float  # (before - level) / |before|; > 0: improved
    grad_median: float | None  # the median total gradient norm over the stretch (None: not recorded)
    start: int  # the plateau's first row
    first: float  # the median loss of the run's first n_edge finite steps
    best: float  # the lowest trailing median of the loss


def _measure(rt: RankTrace, loss: np.ndarray, nonfinite: np.ndarray, cfg: LossPlateauConfig) -> _Plateau | None:
    t0 = len(loss) - int(len(loss) * cfg.tail_frac)
    if nonfinite[t0:].any():
        return None  # the run blew up: nonfinite / loss_divergence
    tail = loss[t0:][np.isfinite(loss[t0:])]  # steps whose loss was not passed left out
    if len(tail) < cfg.min_tail_steps:
        return None
    n_edge = max(1, int(len(tail) * cfg.edge_frac))
    before = float(np.median(tail[:n_edge]))
    level = float(np.median(tail[-n_edge:]))
    if before == 0.0:
        return None  # a loss of exactly zero has nothing left to improve
    change = (before - level) / abs(before)  # > 0: improved
    if abs(change) >= cfg.min_improvement:
        return None
    g = rt.total_grad_norm.to_numpy()[t0:]
    g = g[np.isfinite(g)]
    grad_median = float(np.median(g)) if g.size else None
    if grad_median is not None and grad_median == 0.0:
        return None  # nothing learns at all: vanishing_gradients says so
    tm = trailing_median(loss, n_edge)
    finite = loss[np.isfinite(loss)]
    return _Plateau(t0, n_edge, before, level, change, grad_median, _plateau_start(tm, level, n_edge, t0, cfg),
                    first=float(np.median(finite[:n_edge])), best=float(np.nanmin(tm)))


def _plateau_start(tm: np.ndarray, level: float, n_edge: int, t0: int, cfg: LossPlateauConfig) -> int:
    """The row after the last one, up to the judged stretch, whose trailing median ``tm`` (over as
    many steps as the medians compared) lay outside the plateau's band; 0 if none did."""
    band = abs(level) * cfg.min_improvement
    outside = np.flatnonzero(~(np.abs(tm[n_edge - 1: t0 + 1] - level) <= band))
    return n_edge - 1 + int(outside[-1]) + 1 if outside.size else 0


def _evidence(p: _Plateau, steps: np.ndarray, n_steps: int, cfg: LossPlateauConfig) -> Evidence:
    return {
        "plateau_start_step": int(steps[p.start]),
        "steps_on_plateau": int(n_steps - p.start),
        "loss_level": p.level,
        "judged_steps": [int(steps[p.t0]), int(steps[-1])],
        "median_loss_first_part": p.before,
        "median_loss_last_part": p.level,
        "relative_improvement": p.change,
        "threshold_improvement": cfg.min_improvement,
        "start_loss": p.first,
        "best_smoothed_loss": p.best,
        "median_total_grad_norm": p.grad_median,
    }


def _summary(p: _Plateau, steps: np.ndarray, n_steps: int) -> str:
    since = "from the start" if p.start < p.n_edge else f"since step {int(steps[p.start])}"
    overall = (f"; over the whole run it went from {p.first:.4g} to {p.level:.4g}"
               + (f" ({(p.level - p.first) / abs(p.first):+.0%})" if p.first != 0 else ""))
    grads = (f", while the gradients are not zero (median norm of all of them together, biases included: "
             f"{p.grad_median:.3g})"
             if p.grad_median is not None else "")
    return (f"The loss has plateaued at {p.level:.4g} {since} ({n_steps - p.start:,} steps): over steps "
            f"{int(steps[p.t0])}-{int(steps[-1])} it changed by {-p.change:+.1%}{grads}{overall}.")
