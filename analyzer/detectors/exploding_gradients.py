"""exploding_gradients: the total gradient norm grows without bound or jumps by orders of magnitude.

Two definitions, both from what the pathology is (Pascanu et al. 2013; He et al. 2015):

- Present from the first steps, across depth (``_exploding_at_init``): early layers' weight
  gradients >= 100x the late layers', or activations growing >= 100x through successive layers.
- Arising in the run: the median total gradient norm over the first healthy steps (finite, non-
  zero, loss not exactly 0) is the baseline. Sustained growth (the trailing median over `window`
  steps above `sustained_ratio` x baseline, 100) is an error; a lone jump above `spike_ratio`
  (1000) x baseline is a warning. The event is dated where the norm first stood `onset_factor`
  (30) x above the healthy steps just before it, and the parameters named are those whose own
  gradient norm grew most there. A blow-up inside the baseline's own steps (a learning rate ~1000x
  too high: the first update moves every weight, the next step's norm is 1e3-1e4x the first)
  would be taken for the run's level; so where, within those steps, the norm stands
  `sustained_ratio` x above the steps before it for `window` steps while the loss stands
  EARLY_RATIO (3) x above its first value (loss_divergence's early rise: what tells it from a
  zero-initialised layer, whose gradient is ~0 at step 0 while the loss falls), the baseline is
  the steps before the jump.
"""

from __future__ import annotations

from dataclasses import dataclass

import warnings

import numpy as np

from ..findings import Finding
from ..series import trailing_median
from ..trace import RankTrace
from ._exploding_at_init import detect_at_init
from ._missing import no_gradients
from ._schedule import LrEvidence, lr_context
from .loss_divergence import EARLY_RATIO


@dataclass(frozen=True)
class ExplodingGradientsConfig:
    # Early baseline: median total gradient norm over the first finite steps of the run
    # (10% of the run, at least 5 and at most 50 steps).
    baseline_min_steps: int = 5
    baseline_max_steps: int = 50
    # Sustained: the trailing median over `window` steps exceeds the baseline this many times.
    # Two orders of magnitude: on our healthy sample traces the total gradient norm stays within
    # ~10x of its early median (measured; see README's table), while a learning rate too high
    # passes 100x within a few steps of the divergence (Pascanu et al. 2013 describe the blow-up).
    sustained_ratio: float = 100.0
    window: int = 5
    # A single-step jump this many times the baseline, not sustained, is reported as a warning.
    spike_ratio: float = 1000.0
    # Dating: an event began where the norm first stood `onset_factor` x above the median of the
    # `pre_window` healthy steps before it (and stayed so); the parameters named grew most there.
    # 30x, an order and a half of magnitude: tuned on the tuning half, whose oracles date a ramp
    # of ~3x a step at its 10x or its 100x crossing (within 2 steps of both).
    onset_factor: float = 30.0
    pre_window: int = 50
    # Present from the first steps, judged across depth (see detectors/_exploding_at_init.py).
    # Backward: the first third of the weights' gradient RMS over the last third's, median of
    # the first `depth_steps` steps; two orders of magnitude, as `sustained_ratio` (the
    # vanishing detector's mirror). Healthy corpus runs stay under ~30.
    depth_ratio: float = 100.0
    depth_steps: int = 5
    # ... unless the run trains anyway: its loss falls this many times from its first steps to its
    # last tenth (measured: 0.73-1.0x in the corpus's chaotic and recurrent explosions from init,
    # 0.01-0.03x in healthy MobileNetV2, ConvNeXt and ResNets whose depth profiles reach 200x).
    trained_drop: float = 3.0
    # With no layer to compare: one leaf module's output this many times the largest scale before
    # it in the forward, on the first watched step (_exploding_at_init._amplified). Healthy runs:
    # at most 48x (a LayerNorm after a small embedding, not judged) and under 3x elsewhere, in the
    # corpus and 5 transformers vision models; a ReLU RNN of spectral radius 3: 3.4e6x (measured).
    amplification: float = 1000.0
    # Forward: on the first watched step, `chain_layers` or more successive weighted layers'
    # outputs each at least `layer_gain` x the one before, `activation_growth` x in all (He et
    # al. 2015: a gain g per layer multiplies the signal by g^depth). Healthy corpus runs: <4x.
    activation_growth: float = 100.0
    layer_gain: float = 1.5
    chain_layers: int = 4


class Evidence(LrEvidence, total=False):
    # Growth in the run (an error when sustained, a warning for a lone jump):
    baseline_total_grad_norm: float  # median total gradient norm of the first healthy steps
    baseline_steps: list  # [first, last] step of that baseline
    total_grad_norm_at_step: float  # the total gradient norm at the finding's step (its onset)
    ratio_at_step: float  # ... over the baseline (inf: not finite)
    peak_step: int  # the step of the highest finite total norm from the onset on
    peak_total_grad_norm: float  # ... that norm
    peak_ratio: float  # ... over the baseline
    first_nonfinite_step: int  # the first step from the onset on whose total norm was NaN/Inf (None: none)
    growth_by_parameter: dict  # {parameter: its gradient norm at the onset over its median just before} (top 3)
    threshold_ratio: float  # the ratio to a baseline that counts: sustained_ratio or spike_ratio (in the
    #                         run), depth_ratio (across depth)
    # Present from the first steps, across depth (_exploding_at_init.py):
    steps: int | list  # backward, across depth: [first, last] step judged; no gradient at all: how
    #                    many steps the trace holds
    early_to_late_rms_ratio: float  # largest gradient RMS of the first third of the weights over the
    #                                 median of the last third's (median over the first depth_steps)
    early_grad_rms: dict  # {weight: its gradient RMS}, first third of the weights
    late_grad_rms: dict  # {weight: its gradient RMS}, last third
    step: int  # forward, across depth: the step whose activations were judged (the first watched)
    activation_growth: float  # how many times the chain's last layer's output RMS is its first one's
    threshold_growth: float  # the activation_growth that counts (activation_growth of the config)
    gain_per_layer: float  # the chain's growth per layer (geometric mean)
    output_rms: dict  # {layer: its output RMS} along the chain (amplified: of the amplifying layer)
    # With nothing to compare to (_exploding_at_init._amplified):
    amplification: float  # how many times its output RMS is the largest RMS before it (batch included)
    threshold_amplification: float  # the amplification that counts (of the config)
    input_rms: float  # that largest RMS before it
    # No gradient was recorded (_missing.py):
    parameters: int  # how many parameters the trace names


KIND = "exploding_gradients"
REQUIRES = ("params/grad_norm",)
CONFIG = ExplodingGradientsConfig  # its thresholds: a [exploding_gradients] table of analyze --config
ORDER = 20  # among findings of one step and stage, the detectors run (and list) in this order

ADVICE = (
    "Lower the learning rate (often by 3-10x) or add a warm-up; clip the gradient norm "
    "(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)); check the named layers' "
    "initialisation and whether a normalisation layer is missing before them."
)


def detect(rt: RankTrace, cfg: ExplodingGradientsConfig) -> list[Finding]:
    missing = no_gradients(rt, KIND)
    if missing:
        return missing
    return detect_at_init(rt, cfg, ADVICE, KIND) + _growth(rt, cfg)


def _growth(rt: RankTrace, cfg: ExplodingGradientsConfig) -> list[Finding]:
    """The run against its own healthy steps: sustained growth or a jump of the total norm."""
    event = _measure_growth(rt, cfg)
    if event is None:
        return []
    severity, i, evidence, where = event
    step = int(rt.step_index[i])
    lr_evidence, lr_clause = lr_context(rt, i)
    evidence.update(lr_evidence)
    summary = _growth_summary(evidence, severity, step, where, lr_clause)
    return [Finding(KIND, severity, step, where, summary, evidence, ADVICE)]


def _measure_growth(rt: RankTrace, cfg: ExplodingGradientsConfig) -> tuple[str, int, dict, list[str]] | None:
    """(severity, onset row, evidence, fastest-growing parameters) of the first sustained growth
    (error) or lone jump (warning) of the total norm over its healthy baseline, or None."""
    total = rt.total_grad_norm.to_numpy()
    steps = rt.step_index
    # A baseline from healthy steps only: a step whose loss is exactly 0 has (near) zero
    # gradients, against which any ordinary gradient would look like an explosion.
    healthy = np.isfinite(total) & (total > 0) & (rt.columns["loss"].to_numpy() != 0)
    idx = np.flatnonzero(healthy)
    n_base = int(np.clip(len(total) // 10, cfg.baseline_min_steps, cfg.baseline_max_steps))
    if len(idx) < n_base + 1:
        return None
    base_idx = _before_early_jump(total, rt.columns["loss"].to_numpy(dtype=np.float64), idx[:n_base], cfg)
    baseline = float(np.median(total[base_idx]))
    # Non-finite norms count as unbounded growth: the explosion ended in overflow.
    ratio = np.where(np.isnan(total), np.nan, total / baseline)
    ratio = np.where(np.isinf(total), np.inf, ratio)
    found = _crossing(ratio, np.arange(len(total)) > base_idx[-1], cfg)
    if found is None:
        return None
    severity, i = found
    i, pre = _run_up(total, healthy, i, base_idx[-1] + 1, cfg)
    later = np.arange(len(total)) >= i
    finite_after = np.flatnonzero(np.isfinite(total) & later)
    peak_i = int(finite_after[np.argmax(total[finite_after])]) if finite_after.size else i
    first_nonfinite = np.flatnonzero(~np.isfinite(total) & later)
    growth = _parameter_growth(rt, pre, i)
    top = [j for j in np.argsort(-np.nan_to_num(growth, nan=-1.0, posinf=np.finfo(float).max))
           if not np.isnan(growth[j])][:3]
    evidence = {
        "baseline_total_grad_norm": baseline,
        "baseline_steps": [int(steps[base_idx[0]]), int(steps[base_idx[-1]])],
        "total_grad_norm_at_step": float(total[i]),
        "ratio_at_step": float(ratio[i]),
        "peak_step": int(steps[peak_i]),
        "peak_total_grad_norm": float(total[peak_i]),
        "peak_ratio": float(total[peak_i] / baseline),
        "first_nonfinite_step": int(steps[first_nonfinite[0]]) if first_nonfinite.size else None,
        "growth_by_parameter": {rt.param_names[j]: float(growth[j]) for j in top},
        "threshold_ratio": cfg.sustained_ratio if severity == "error" else cfg.spike_ratio,
    }
    return severity, i, evidence, [rt.param_names[j] for j in top]


def _before_early_jump(total: np.ndarray, loss: np.ndarray, base_idx: np.ndarray,
                       cfg: ExplodingGradientsConfig) -> np.ndarray:
    """The baseline's rows, cut before a blow-up inside them: the first row whose norm and the
    next `window` rows' median stand `sustained_ratio` x above the median of the rows before
    it, while the loss's median over those rows stands EARLY_RATIO x above the first row's."""
    for k in range(1, len(base_idx)):
        i = base_idx[k]
        level = float(np.median(total[base_idx[:k]]))
        ahead = total[i:i + cfg.window]
        if not (level > 0 and total[i] >= cfg.sustained_ratio * level and len(ahead) == cfg.window
                and np.median(ahead) >= cfg.sustained_ratio * level):
            continue
        first_loss, later = loss[base_idx[0]], loss[i:i + cfg.window]
        if np.isfinite(first_loss) and first_loss > 0 and np.median(later) >= EARLY_RATIO * first_loss:
            return base_idx[:k]
    return base_idx


def _crossing(ratio: np.ndarray, after: np.ndarray, cfg: ExplodingGradientsConfig) -> tuple[str, int] | None:
    """(severity, row) where the norm over its baseline first crossed a line after the baseline."""
    sustained = np.flatnonzero(after & (trailing_median(ratio, cfg.window) >= cfg.sustained_ratio))
    if sustained.size:
        # The event starts at the first step of the window whose median crossed the line.
        end = sustained[0]
        start_candidates = np.flatnonzero(after[: end + 1] & (ratio[: end + 1] >= cfg.sustained_ratio))
        return "error", int(start_candidates[0]) if start_candidates.size else int(end)
    spikes = np.flatnonzero(after & (ratio >= cfg.spike_ratio) & np.isfinite(ratio))
    return ("warning", int(spikes[0])) if spikes.size else None


def _parameter_growth(rt: RankTrace, pre: np.ndarray, i: int) -> np.ndarray:
    """Per parameter, its gradient norm at the onset row i over its median over the healthy rows
    ``pre`` just before: where the explosion began. Only the rows it needs are read."""
    rows = np.unique(np.append(pre, i))
    g = rt.param_stat("grad_norm", rows=rows).to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a parameter without any gradient
        p_base = np.nanmedian(g[np.searchsorted(rows, pre)], axis=0)
        return g[np.searchsorted(rows, i)] / p_base


def _growth_summary(ev: dict, severity: str, step: int, where: list[str], lr_clause: str) -> str:
    how = "grew" if severity == "error" else "jumped"
    tail = (f", and went non-finite at step {ev['first_nonfinite_step']}"
            if ev["first_nonfinite_step"] is not None else "")
    summary = (f"Total gradient norm {how} from {ev['baseline_total_grad_norm']:.3g} (median of steps "
               f"{ev['baseline_steps'][0]}-{ev['baseline_steps'][1]}) to {ev['total_grad_norm_at_step']:.3g} "
               f"at step {step} ({ev['ratio_at_step']:.3g}x), peaking at {ev['peak_total_grad_norm']:.3g} "
               f"at step {ev['peak_step']}{tail}; fastest growth in {', '.join(where) or 'all layers'}.")
    return summary[:-1] + f"; it began {lr_clause}." if lr_clause else summary


def _run_up(total: np.ndarray, healthy: np.ndarray, i: int, lo: int,
            cfg: ExplodingGradientsConfig) -> tuple[int, np.ndarray]:
    """Date the event where it began: walk back from step index i while the norm was already
    `onset_factor` x above the healthy steps before the event (or not finite). Returns the onset and the rows of those healthy steps."""
    before = np.flatnonzero(healthy[:i])
    pre = before[-cfg.pre_window:]
    if not pre.size:
        return i, np.array([i])
    level = float(np.median(total[pre]))
    j = i
    while j - 1 >= lo and not total[j - 1] < cfg.onset_factor * level:
        j -= 1
    pre = before[before < j][-cfg.pre_window:]
    return j, pre if pre.size else np.array([j])
