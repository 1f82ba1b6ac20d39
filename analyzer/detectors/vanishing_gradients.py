"""vanishing_gradients: early layers' gradients orders of magnitude below the late ones, or near zero.

Heuristic: over weight matrices/kernels (parameters of 2+ dimensions, in named_parameters()
order, which follows the model's definition and usually its depth), take each one's gradient
RMS (L2 norm / sqrt(numel), so layers of different size compare) and its median over the last
`window_frac` of the run. The ratio of the smallest RMS among the first third of them to the
median RMS of the last third falling under `ratio` — or an early RMS under `near_zero_rms` — is
a warning. The onset is the first step where the trailing median of that ratio falls under.
"""

from __future__ import annotations

from dataclasses import dataclass

import warnings

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..series import trailing_median
from ..trace import RankTrace
from ..trace.gradients import median_grad_rms
from ..trace.streaming import weight_thirds
from ._missing import no_gradients


@dataclass(frozen=True)
class VanishingGradientsConfig:
    # Ratio of the gradient RMS of the earliest weight matrices to that of the last ones. Below
    # 1e-3 (three orders of magnitude) the early layers effectively stop learning; healthy sample
    # traces (MLP/ReLU) stay above 1e-1 (measured), a 12-layer sigmoid MLP falls below 1e-5
    # (Glorot & Bengio 2010 measured the same decay through sigmoid layers).
    ratio: float = 1e-3
    # Absolute floor: an early-layer weight gradient RMS below this is "near zero" in float32.
    near_zero_rms: float = 1e-10
    # Judged over the last quarter of the run (at least `min_window` steps) so a slow start
    # does not count; the onset is where the trailing median of the ratio first falls below.
    window_frac: float = 0.25
    min_window: int = 5
    onset_window: int = 5


class Evidence(FindingEvidence, total=False):
    window_steps: list  # [first, last] step of the judged window (the last window_frac of the run)
    early_to_late_rms_ratio: float  # smallest median gradient RMS of the first third of the weights
    #                                 over the median of the last third's, over that window
    threshold_ratio: float  # the ratio under which early layers count as vanishing (ratio of the config)
    early_grad_rms: dict  # {weight: its median gradient RMS over the window}, first third
    late_grad_rms: dict  # {weight: ...}, last third
    max_grad_rms: float  # every gradient zero: the largest median gradient RMS of any weight
    weights_checked: int  # ... over this many weight tensors
    steps: int  # no gradient was recorded (_missing.py): how many steps the trace holds
    parameters: int  # ... and how many parameters it names


KIND = "vanishing_gradients"
REQUIRES = ("params/grad_norm",)
CONFIG = VanishingGradientsConfig  # its thresholds: a [vanishing_gradients] table of analyze --config
ORDER = 30  # among findings of one step and stage, the detectors run (and list) in this order

ADVICE = (
    "Use non-saturating activations (ReLU/GELU instead of sigmoid/tanh in deep stacks), an "
    "initialisation matched to them (Kaiming/He for ReLU), residual connections or normalisation "
    "layers (LayerNorm/BatchNorm) between blocks; check that no detach() or frozen block cuts the "
    "gradient path to the early layers."
)


def detect(rt: RankTrace, cfg: VanishingGradientsConfig) -> list[Finding]:
    missing = no_gradients(rt, KIND)
    if missing:
        return missing
    thirds = weight_thirds(rt.param_shapes)
    if thirds is None:
        return []
    weights, early, late = thirds
    # (made in the digest's pass over the gradient norms, which other detectors read anyway)
    per_step, ok_rows = rt.digest.early_to_late, rt.digest.weight_grads
    if ok_rows.sum() < cfg.min_window:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rows = np.flatnonzero(ok_rows)
        win = rows[-max(cfg.min_window, int(len(rows) * cfg.window_frac)):]
        med = median_grad_rms(rt, win, weights)  # per weight tensor, over the window
        early_min = np.nanmin(med[early])
        late_med = np.nanmedian(med[late])
    if not (np.isfinite(early_min) and np.isfinite(late_med)):
        return []
    names = [rt.param_names[j] for j in weights]
    if late_med <= 0:
        return _all_zero(rt, med, names, win, cfg)
    ratio = early_min / late_med
    near_zero = early_min < cfg.near_zero_rms
    if not (ratio < cfg.ratio or near_zero):
        return []
    # The onset: the first step where the trailing median of the per-step ratio fell under.
    onset = np.flatnonzero(trailing_median(per_step, cfg.onset_window) < cfg.ratio)
    step = int(rt.step_index[int(onset[0]) if onset.size else int(win[0])])
    worst = [names[j] for j in np.argsort(med[early])[:3] if med[early][j] <= ratio * 10 * late_med or near_zero]
    where = worst or [names[int(np.nanargmin(med[early]))]]
    evidence = {
        "window_steps": [int(rt.step_index[win[0]]), int(rt.step_index[win[-1]])],
        "early_to_late_rms_ratio": float(ratio),
        "threshold_ratio": cfg.ratio,
        "early_grad_rms": {names[j]: float(med[j]) for j in range(early.stop)},
        "late_grad_rms": {names[j]: float(med[j]) for j in range(late.start, late.stop)},
    }
    summary = _summary(evidence, early_min, late_med, near_zero, where[0], step, cfg)
    return [Finding(KIND, "warning", step, where, summary, evidence, ADVICE)]


def _summary(ev: dict, early_min: float, late_med: float, near_zero: bool, worst: str, step: int,
             cfg: VanishingGradientsConfig) -> str:
    ratio = ev["early_to_late_rms_ratio"]
    span = f"steps {ev['window_steps'][0]}-{ev['window_steps'][1]}"
    if near_zero and ratio >= cfg.ratio:
        return f"Gradients of the early layers are near zero (RMS {early_min:.3g} in {worst}, {span})."
    factor = f"{1 / ratio:.3g}x smaller than" if ratio > 0 else "zero, unlike"
    return (f"Gradients of the early layers are {factor} those of the late "
            f"layers (gradient RMS {early_min:.3g} in {worst} vs median {late_med:.3g} in the "
            f"last layers, {span}); below the {cfg.ratio:g} ratio since step {step}.")


def _all_zero(rt: RankTrace, med: np.ndarray, names: list[str], win: np.ndarray,
              cfg: VanishingGradientsConfig) -> list[Finding]:
    """The late layers' gradients are zero: if the early ones are too, nothing learns."""
    if np.nanmax(med) >= cfg.near_zero_rms:
        return []
    span = [int(rt.step_index[win[0]]), int(rt.step_index[win[-1]])]
    summary = (f"Every weight gradient is zero (or below {cfg.near_zero_rms:g} RMS) over steps "
               f"{span[0]}-{span[1]}: no layer is learning.")
    evidence = {"window_steps": span, "max_grad_rms": float(np.nanmax(med)),
                "weights_checked": len(names)}
    advice = ("A gradient of exactly zero everywhere usually means the loss does not depend on the "
              "parameters: a detach() or torch.no_grad() in the forward pass, a final ReLU whose "
              "units are all dead, or a loss on a constant. " + ADVICE)
    return [Finding(KIND, "warning", span[0], names[:3], summary, evidence, advice)]
