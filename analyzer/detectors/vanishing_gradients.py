"""vanishing_gradients: early layers' gradients orders of magnitude below the late ones, or near zero.

Heuristic: over weight matrices/kernels (parameters of 2+ dimensions, in named_parameters()
order, which follows the model's definition and usually its depth), take each one's gradient
RMS (L2 norm / sqrt(numel), so layers of different size compare) and its median over the last
`window_frac` of the run. The ratio of the smallest RMS among the first third of them to the
median RMS of the last third falling under `ratio` — or an early RMS under `near_zero_rms` — is
a warning. The onset is the first step where the trailing median of that ratio falls under.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..config import VanishingGradientsConfig
from ..findings import Finding
from ..series import evenly_spaced, sample_rows, trailing_median
from ..trace import RankTrace
from ._missing import no_gradients

KIND = "vanishing_gradients"
REQUIRES = ("params/grad_norm",)

# Rows read at most for the per-layer median over the judged window (see detect).
MAX_WINDOW_ROWS = 20_000

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
    weights = [j for j, shape in enumerate(rt.param_shapes) if len(shape) >= 2]
    if len(weights) < 3:
        return []
    numel = rt.param_numel[weights].astype(np.float64)
    third = max(1, len(weights) // 3)
    early, late = slice(0, third), slice(len(weights) - third, len(weights))

    # One pass over the gradient norms, a block at a time: per step, the smallest early RMS over
    # the median late RMS, and whether any weight had a gradient.
    per_step = np.full(rt.n_steps, np.nan)
    ok_rows = np.zeros(rt.n_steps, dtype=bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for a, block in rt.blocks("params/grad_norm"):
            rms = grad_rms(block[:, weights], numel)
            ok_rows[a:a + len(rms)] = ~np.isnan(rms).all(axis=1)
            per_step[a:a + len(rms)] = np.nanmin(rms[:, early], axis=1) / np.nanmedian(rms[:, late], axis=1)
    if ok_rows.sum() < cfg.min_window:
        return []

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rows = np.flatnonzero(ok_rows)
        n_win = max(cfg.min_window, int(len(rows) * cfg.window_frac))
        win = rows[-n_win:]
        # The per-layer median over the window, from an evenly spaced sample of its rows when it
        # is long: the same median within noise, in bounded memory.
        sample = evenly_spaced(win, sample_rows(len(weights), MAX_WINDOW_ROWS))
        g = rt.param_stat("grad_norm", rows=sample).to_numpy(dtype=np.float64)[:, weights]
        med = np.nanmedian(grad_rms(g, numel), axis=0)
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

    below = trailing_median(per_step, cfg.onset_window) < cfg.ratio
    onset = np.flatnonzero(below)
    step_i = int(onset[0]) if onset.size else int(win[0])
    worst = [names[j] for j in np.argsort(med[early])[:3] if med[early][j] <= ratio * 10 * late_med or near_zero]
    where = worst or [names[int(np.nanargmin(med[early]))]]
    evidence = {
        "window_steps": [int(rt.step_index[win[0]]), int(rt.step_index[win[-1]])],
        "early_to_late_rms_ratio": float(ratio),
        "threshold_ratio": cfg.ratio,
        "early_grad_rms": {names[j]: float(med[j]) for j in range(early.stop)},
        "late_grad_rms": {names[j]: float(med[j]) for j in range(late.start, late.stop)},
    }
    factor = f"{1 / ratio:.3g}x smaller than" if ratio > 0 else "zero, unlike"
    summary = (f"Gradients of the early layers are {factor} those of the late "
               f"layers (gradient RMS {early_min:.3g} in {where[0]} vs median {late_med:.3g} in the "
               f"last layers, steps {evidence['window_steps'][0]}-{evidence['window_steps'][1]}); "
               f"below the {cfg.ratio:g} ratio since step {int(rt.step_index[step_i])}.")
    if near_zero and ratio >= cfg.ratio:
        summary = (f"Gradients of the early layers are near zero (RMS {early_min:.3g} in {where[0]}, "
                   f"steps {evidence['window_steps'][0]}-{evidence['window_steps'][1]}).")
    return [Finding(KIND, "warning", int(rt.step_index[step_i]), where, summary, evidence, ADVICE)]


def grad_rms(g: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Gradient RMS (L2 norm / sqrt(numel)), NaN where not finite (exploding_gradients' depth
    rule uses it too)."""
    rms = np.asarray(g, dtype=np.float64) / np.sqrt(numel)
    rms[~np.isfinite(rms)] = np.nan
    return rms


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
