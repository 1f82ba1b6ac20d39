"""exploding_gradients: the total gradient norm grows without bound or jumps by orders of magnitude.

Present from the first step (a broken initialisation: chaotic-regime weights, a recurrent
matrix of spectral radius above 1, a gain too large; Pascanu et al. 2013, Poole et al. 2016):
a weight tensor whose gradient norm is `init_ratio` x its own norm or more on each of the first
`init_samples` steps whose weight norms were measured. An update moves a healthy weight by a
small fraction of itself (gradient/weight well under 1 at initialisation); a gradient tens of
times the weight makes every step replace it. Such a run is its own baseline, so it is judged
by this rule alone.

Arising later: take the median total gradient norm over the first finite steps as the baseline.
Sustained growth (the trailing median over `window` steps above `sustained_ratio` x baseline) is
an error; a lone jump above `spike_ratio` x baseline that does not last is a warning. The
parameters named are those whose own gradient norm grew most against their own baseline.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..config import ExplodingGradientsConfig
from ..findings import Finding
from ..series import trailing_median
from ..trace import RankTrace
from ._missing import no_gradients
from ._schedule import lr_context

KIND = "exploding_gradients"
REQUIRES = ("params/grad_norm",)

ADVICE = (
    "Lower the learning rate (often by 3-10x) or add a warm-up; clip the gradient norm "
    "(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)); check the named layers' "
    "initialisation and whether a normalisation layer is missing before them."
)


def detect(rt: RankTrace, cfg: ExplodingGradientsConfig) -> list[Finding]:
    missing = no_gradients(rt, KIND)
    if missing:
        return missing
    steps = rt.step_index
    at_init = _from_initialisation(rt, cfg)
    if at_init is not None:
        return [at_init]
    total = rt.total_grad_norm.to_numpy()
    finite = np.isfinite(total) & (total > 0)
    idx = np.flatnonzero(finite)
    n_base = int(np.clip(len(total) // 10, cfg.baseline_min_steps, cfg.baseline_max_steps))
    if len(idx) < n_base + 1:
        return []
    base_idx = idx[:n_base]
    baseline = float(np.median(total[base_idx]))
    # Non-finite norms count as unbounded growth: the explosion ended in overflow.
    ratio = np.where(np.isnan(total), np.nan, total / baseline)
    ratio = np.where(np.isinf(total), np.inf, ratio)

    after = np.arange(len(total)) > base_idx[-1]
    trailing = trailing_median(ratio, cfg.window)
    sustained = np.flatnonzero(after & (trailing >= cfg.sustained_ratio))
    if sustained.size:
        # The event starts at the first step of the window whose median crossed the line.
        end = sustained[0]
        start_candidates = np.flatnonzero(after[: end + 1] & (ratio[: end + 1] >= cfg.sustained_ratio))
        i = int(start_candidates[0]) if start_candidates.size else int(end)
        severity, how = "error", "grew"
    else:
        spikes = np.flatnonzero(after & (ratio >= cfg.spike_ratio) & np.isfinite(ratio))
        if not spikes.size:
            return []
        i = int(spikes[0])
        severity, how = "warning", "jumped"

    finite_after = np.flatnonzero(np.isfinite(total) & (np.arange(len(total)) >= i))
    peak_i = int(finite_after[np.argmax(total[finite_after])]) if finite_after.size else i
    first_nonfinite = np.flatnonzero(~np.isfinite(total) & (np.arange(len(total)) >= i))

    # Which parameters: growth of each one's own norm at the peak against its own baseline.
    # Only the rows it needs are read: the baseline's and the peak's.
    rows = np.unique(np.append(base_idx, peak_i))
    g = rt.param_stat("grad_norm", rows=rows).to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a parameter without any gradient
        p_base = np.nanmedian(g[np.searchsorted(rows, base_idx)], axis=0)
        p_growth = g[np.searchsorted(rows, peak_i)] / p_base
    order = [j for j in np.argsort(-np.nan_to_num(p_growth, nan=-1.0)) if np.isfinite(p_growth[j])]
    top = order[:3]
    where = [rt.param_names[j] for j in top]

    step = int(steps[i])
    evidence = {
        "baseline_total_grad_norm": baseline,
        "baseline_steps": [int(steps[base_idx[0]]), int(steps[base_idx[-1]])],
        "total_grad_norm_at_step": float(total[i]),
        "ratio_at_step": float(ratio[i]),
        "peak_step": int(steps[peak_i]),
        "peak_total_grad_norm": float(total[peak_i]),
        "peak_ratio": float(total[peak_i] / baseline),
        "first_nonfinite_step": int(steps[first_nonfinite[0]]) if first_nonfinite.size else None,
        "growth_by_parameter": {rt.param_names[j]: float(p_growth[j]) for j in top},
        "threshold_ratio": cfg.sustained_ratio if severity == "error" else cfg.spike_ratio,
    }
    tail = (f", and went non-finite at step {evidence['first_nonfinite_step']}"
            if evidence["first_nonfinite_step"] is not None else "")
    summary = (f"Total gradient norm {how} from {baseline:.3g} (median of steps "
               f"{evidence['baseline_steps'][0]}-{evidence['baseline_steps'][1]}) to {float(total[i]):.3g} "
               f"at step {step} ({float(ratio[i]):.3g}x), peaking at {evidence['peak_total_grad_norm']:.3g} "
               f"at step {evidence['peak_step']}{tail}; fastest growth in {', '.join(where) or 'all layers'}.")
    lr_evidence, lr_clause = lr_context(rt, i)
    evidence.update(lr_evidence)
    if lr_clause:
        summary = summary[:-1] + f"; it began {lr_clause}."
    return [Finding(KIND, severity, step, where, summary, evidence, ADVICE)]


def _from_initialisation(rt: RankTrace, cfg: ExplodingGradientsConfig) -> Finding | None:
    """Weight gradients tens of times the weights themselves on the first measured steps."""
    n = min(rt.n_steps, 20 * cfg.init_samples * 10)  # (weights are measured on watched steps)
    mats = np.flatnonzero([len(s) >= 2 for s in rt.param_shapes])  # weight matrices and kernels
    if n == 0 or not mats.size:
        return None
    w = rt.param_stat("param_norm", rows=slice(0, n)).to_numpy()[:, mats].astype(float)
    g = rt.param_stat("grad_norm", rows=slice(0, n)).to_numpy()[:, mats].astype(float)
    rows = np.flatnonzero((w >= 0).any(axis=1))[: cfg.init_samples]  # (-1: not measured)
    if len(rows) < min(2, cfg.init_samples):
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(w[rows] > 0, g[rows] / w[rows], np.nan)
    ratio[~np.isfinite(g[rows])] = np.nan  # (NaN/Inf gradients are the nonfinite detector's)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        worst = np.nanmax(ratio, axis=1)
    if not np.isfinite(worst).all() or worst.min() < cfg.init_ratio:
        return None
    first = ratio[0]
    bad = [int(j) for j in np.argsort(-np.nan_to_num(first, nan=-1)) if first[j] >= cfg.init_ratio]
    names = [rt.param_names[mats[j]] for j in bad]
    step = int(rt.step_index[rows[0]])
    summary = (f"Gradients larger than the weights themselves from the first step: at step {step} the gradient "
               f"norm of {names[0]} is {first[bad[0]]:.3g}x its weight norm, and {len(names)} weight tensor(s) are "
               f"above {cfg.init_ratio:g}x on each of the first {len(rows)} measured steps (a healthy "
               f"initialisation gives well under 1x): the initialisation, or the scale of the inputs, is broken.")
    evidence = {
        "from_initialisation": True,
        "grad_to_weight_ratio_at_first_step": {names[k]: float(first[j]) for k, j in enumerate(bad[:20])},
        "worst_ratio_per_measured_step": [float(x) for x in worst],
        "measured_steps": [int(rt.step_index[r]) for r in rows],
        "threshold": cfg.init_ratio,
    }
    advice = ("Initialise the weights for the activation (He/Kaiming for ReLU, Xavier/Glorot for tanh; "
              "orthogonal or spectral radius <= 1 for recurrent matrices), normalise the inputs, and add "
              "normalisation layers; clipping the gradient norm only hides it.")
    return Finding(KIND, "error", step, names[:8], summary, evidence, advice)
