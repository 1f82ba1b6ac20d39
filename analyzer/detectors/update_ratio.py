"""update_ratio: weight updates far too large or far too small against the weights themselves.

Heuristic: the recorder samples each parameter's update-to-weight ratio ||w_after - w_before|| /
||w_before|| every `update_ratio_every` steps (default 10). A healthy ratio is "somewhere around
1e-3" (Karpathy, CS231n "Neural Networks Part 3", ratio of weights:updates). For each weight,
take the median of its finite samples over the last `window_frac` of them (at least
`min_samples`; early steps are larger and are left out):

- median > `too_large` (1e-1): warning, the learning rate is too high for these weights;
- median < `too_small` (1e-6) while the weight receives a non-zero gradient (median over the
  same samples): warning, it barely moves (not in the optimizer, learning rate ~0, every step
  skipped, or gradients vanishing). Weights with no gradient (frozen) or an exactly zero one
  (vanishing_gradients and dead_relu report why) are not judged.

Judged: parameters of `min_ndim` (2) or more dimensions only — weight matrices, conv kernels,
embeddings. Biases start at 0 and their ratio is huge or meaningless; norm gains barely move by
design. Weights whose RMS is below `min_weight_rms` when first sampled (zero-initialised: LoRA
B, zero-init output projections) are skipped, since their ratio is relative to ~0; so are
samples where it is. The step named is the first sample of the last stretch, reaching into the
judged window, over which the trailing median of `onset_samples` samples stayed beyond the
threshold, moved back to the first sample of that median's window that was itself beyond it.

Sources: Karpathy's rule of thumb for the usual value; the thresholds sit two orders above and
three below it, and were checked against the sample traces (see UpdateRatioConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..findings import Finding
from ..series import sample_rows, trailing_median
from ..trace import RankTrace
from ._schedule import LrEvidence, lr_context
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class UpdateRatioConfig:
    # Update-to-weight ratio ||dw|| / ||w|| of one optimizer step. "Somewhere around 1e-3" is
    # healthy (Karpathy, CS231n "Neural Networks Part 3": ratio of weights:updates); healthy_mlp's
    # weight matrices sit at 1e-3 - 3e-3 over its last half, 1e-2 at step 0 (measured).
    # Too large: two orders of magnitude above 1e-3; the learning rate is too high.
    too_large: float = 1e-1
    # Too small: three orders below 1e-3, for weights that receive gradients; they barely move.
    # float32 cannot even represent an update below ~6e-8 of a weight (machine epsilon 1.2e-7).
    too_small: float = 1e-6
    # Judged on the median over the last `window_frac` of the sampled updates that are finite
    # (at least `min_samples`): early steps (the first ~50 in healthy_mlp) are larger.
    window_frac: float = 0.5
    min_samples: int = 3
    # The onset is where the trailing median over this many samples first crossed the threshold.
    onset_samples: int = 3
    # Only weights of this many dimensions or more (matrices, kernels, embeddings): biases
    # start at 0 and their ratio is huge or meaningless; norm gains barely move by design.
    min_ndim: int = 2
    # Weights whose RMS (||w|| / sqrt(numel)) is below this at the first recorded step are skipped
    # (zero-initialised, e.g. LoRA B or zero-init residual projections: their ratio is relative
    # to ~0), and so are samples where it is below. Default inits put RMS near 1/sqrt(3 fan_in),
    # above 2e-3 up to fan_in 65536.
    min_weight_rms: float = 1e-4
    # The first sampled update (the run's first step) moving a weight by this many times its own
    # norm: nothing of its initialisation survives one step, a learning rate far too high from
    # the start (the window above leaves early samples out). Measured at step 0: healthy runs of
    # the corpus and 5 transformers vision models at most 0.53; an AdamW lr 1000x too high
    # (transformers GPT-2, BERT under the Trainer) 50-100.
    first_too_large: float = 1.0

    def __post_init__(self):
        _check(self, too_large=(0.0, None), too_small=(0.0, None), window_frac=(0.0, 1.0),
               min_samples=(1, None), onset_samples=(1, None), min_ndim=(0, None),
               min_weight_rms=(0.0, None), first_too_large=(0.0, None))
        if not self.too_small < self.too_large:
            raise ValueError(f"too_small ({self.too_small!r}) must be below too_large ({self.too_large!r})")


class Evidence(LrEvidence, total=False):
    direction: str  # "too_large", "too_small", or "first_too_large" (the run's first update)
    threshold: float  # the update/weight ratio beyond which a weight's median counts (too_large, too_small,
    #                   first_too_large: the first sample's)
    weights_judged: int  # weight tensors with enough samples to judge
    skipped_zero_initialised: list  # weights skipped as zero-initialised (RMS under min_weight_rms; first 20)
    min_ndim: int  # only parameters of this many dimensions or more were judged
    usual_ratio: float  # the usual update/weight ratio, 1e-3 (Karpathy)
    median_ratio_by_parameter: dict  # {weight: its median update/weight ratio over its window}, worst first (20)
    onset_step_by_parameter: dict  # {weight: the step its ratio went out of range}
    median_grad_norm_by_parameter: dict  # {weight: its median gradient L2 norm over that window (None: none)}
    window_steps: list  # [first, last] sampled step of the worst weight's judged window


KIND = "update_ratio"
REQUIRES = ("updates/ratio", "params/param_norm", "params/grad_norm")
CONFIG = UpdateRatioConfig  # its thresholds: a [update_ratio] table of analyze --config
ORDER = 130  # among findings of one step and stage, the detectors run (and list) in this order

# Samples judged at most: a longer run is read every k-th sample (the last one kept), so memory
# stays bounded (~100 MB for 200 tensors); 10,000 samples give medians as sure as all of them,
# and date an onset to 1/10,000 of the run.
MAX_SAMPLES = 10_000

ADVICE_LARGE = (
    "Lower the learning rate (for these parameters at least, via a param group) until the "
    "update/weight ratio is near the usual 1e-3 (each step now changes these weights by more than "
    "a tenth of their size), add or lengthen a warm-up, and clip the gradient norm. With SGD check "
    "that the loss is not summed over a large batch (use the mean)."
)
ADVICE_SMALL = (
    "These weights receive gradients but barely change. Check that they are in the optimizer "
    "(an optimizer built before the model was replaced, moved or wrapped holds other tensors), "
    "that the learning rate and its schedule are not ~0 (e.g. a warm-up from 0 that never ends, "
    "or lr given in the wrong unit), and that a GradScaler is not skipping every step. If the "
    "gradients themselves are tiny, see vanishing_gradients. With gradient accumulation, call "
    "rec.step() once per optimizer step, not per micro-batch."
)


def detect(rt: RankTrace, cfg: UpdateRatioConfig) -> list[Finding]:
    if rt.n_steps == 0 or not rt.param_names:
        return []
    sampled = _sampled_updates(rt, cfg)
    if sampled is None:
        return []
    ratio, rows, sample_steps = sampled
    j = _judge_weights(rt, cfg, ratio, _weight_rms_before(rt, ratio, rows),
                       rt.param_stat("grad_norm", rows=rows).to_numpy(dtype=np.float64), sample_steps)
    findings = []
    context = {"weights_judged": j.judged, "skipped_zero_initialised": j.zero_init[:20],
               "min_ndim": cfg.min_ndim, "usual_ratio": 1e-3}
    if j.large:
        f = _finding(rt, j.large, "too_large", cfg.too_large, context, "Updates are too large", ADVICE_LARGE,
                     reverse=True)
        if j.first_large and min(h["onset_step"] for h in j.first_large.values()) < f.step:
            # too large from the run's first update on, though the judged window dates it later
            first = min(h["onset_step"] for h in j.first_large.values())
            worst = max(h["median"] for h in j.first_large.values())
            f = replace(f, step=first, summary=f.summary[:-1] + f"; the run's first update (step {first}) was "
                                                                f"already {worst:.3g}x the weights.")
        findings.append(f)
    elif j.first_large:  # (too large at first only: the judged window leaves early samples out)
        findings.append(_finding(rt, j.first_large, "first_too_large", cfg.first_too_large, context,
                                 "The first update was larger than the weights", ADVICE_LARGE, reverse=True))
    if j.small:
        findings.append(_finding(rt, j.small, "too_small", cfg.too_small, context,
                                 "Weights barely move", ADVICE_SMALL, reverse=False))
    return findings


def _sampled_updates(rt: RankTrace, cfg: UpdateRatioConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(samples x parameters ratios, their step rows, their steps) of the samples that ran an
    optimizer step, or None when fewer than min_samples did."""
    n = rt.n_samples("updates")
    if n < cfg.min_samples:
        return None
    # A long run has more samples than a median needs: every k-th (the last kept) bounds memory.
    stride = -(-n // sample_rows(len(rt.param_names), MAX_SAMPLES))
    upd = rt.update_ratio(rows=slice((n - 1) % stride, n, stride))
    rows = np.searchsorted(rt.step_index, upd.index.to_numpy())
    rows = np.minimum(rows, rt.n_steps - 1)
    keep = rt.step_index[rows] == upd.index.to_numpy()
    # A step that ran no optimizer step (a GradScaler skip) moved nothing: not a sample of updates.
    keep &= rt.columns["optimizer_steps"].to_numpy()[rows] != 0
    if keep.sum() < cfg.min_samples:
        return None
    return upd.to_numpy(dtype=np.float64)[keep], rows[keep], upd.index.to_numpy()[keep]


def _weight_rms_before(rt: RankTrace, ratio: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per sample and parameter, the weight's RMS before the update (the ratio's denominator)."""
    numel = rt.param_numel.astype(np.float64)
    # The weight norms of the sampled steps and of the steps before them: those rows only.
    prev = np.maximum(rows - 1, 0)
    w_rows = np.unique(np.concatenate([rows, prev]))
    w_norm = rt.param_stat("param_norm", rows=w_rows).to_numpy(dtype=np.float64)
    # ||w_before||: the weight's norm at the end of the previous step where it was recorded; at
    # step 0, ||w_after|| / (1 + ratio), a lower bound that is 0 when the ratio is Inf (w was 0).
    with np.errstate(invalid="ignore", divide="ignore"):
        at_start = w_norm[np.searchsorted(w_rows, rows)] / (1.0 + ratio)
    before = np.where((rows > 0)[:, None], w_norm[np.searchsorted(w_rows, prev)], at_start)
    return before / np.sqrt(np.maximum(numel, 1.0))


@dataclass(frozen=True)
class _Judged:
    large: dict  # {parameter column: _judgement} of the weights updated too much
    small: dict  # ... too little
    judged: int  # weights with enough samples to judge
    zero_init: list  # names of the weights skipped as zero-initialised
    first_large: dict  # ... whose first update (the run's first step) was first_too_large or more


def _judge_weights(rt: RankTrace, cfg: UpdateRatioConfig, ratio: np.ndarray, w_rms: np.ndarray,
                   g: np.ndarray, sample_steps: np.ndarray) -> _Judged:
    large, small, judged, zero_init, first_large = {}, {}, 0, [], {}
    for j, shape in enumerate(rt.param_shapes):
        if len(shape) < cfg.min_ndim:
            continue
        r = ratio[:, j]
        first = np.flatnonzero(~np.isnan(r))
        if not first.size:
            continue
        if w_rms[int(first[0]), j] < cfg.min_weight_rms:
            zero_init.append(rt.param_names[j])
            continue
        ok = np.flatnonzero(np.isfinite(r) & (w_rms[:, j] >= cfg.min_weight_rms))
        if len(ok) < cfg.min_samples:
            continue
        judged += 1
        if ok[0] == 0 and sample_steps[0] == rt.step_index[0] and r[0] >= cfg.first_too_large:
            first_large[j] = {"median": float(r[0]), "onset_step": int(sample_steps[0]),
                              "window_steps": [int(sample_steps[0])] * 2, "median_grad_norm": _nanmedian(g[:1, j])}
        # Judged over the last window_frac of its samples: early updates are larger.
        win = ok[-max(cfg.min_samples, int(np.ceil(len(ok) * cfg.window_frac))):]
        med = float(np.median(r[win]))
        if med > cfg.too_large:
            large[j] = _judgement(r, ok, win, med, sample_steps, g[:, j], cfg, above=True)
        elif med < cfg.too_small and (_nanmedian(g[win, j]) or 0.0) > 0:
            small[j] = _judgement(r, ok, win, med, sample_steps, g[:, j], cfg, above=False)
    return _Judged(large, small, judged, zero_init, first_large)


def _judgement(r, ok, win, med, sample_steps, g, cfg, above: bool) -> dict:
    """The median, its window and the onset of one weight's out-of-range ratio."""
    series = r[ok]
    tm = trailing_median(series, cfg.onset_samples)
    beyond = tm > cfg.too_large if above else tm < cfg.too_small
    k = len(ok) - len(win)  # first position of the window in the valid series
    hits = np.flatnonzero(beyond[k:])
    i = k + int(hits[0]) if hits.size else k
    while i > 0 and beyond[i - 1]:
        i -= 1
    # The trailing median crosses a sample or two late: the first raw sample of its window that
    # was itself beyond the threshold is where it began.
    lo = max(0, i - cfg.onset_samples + 1)
    raw = series[lo:i + 1] > cfg.too_large if above else series[lo:i + 1] < cfg.too_small
    i = lo + int(np.flatnonzero(raw)[0]) if raw.any() else i
    return {"median": med, "onset_step": int(sample_steps[ok[i]]),
            "window_steps": [int(sample_steps[win[0]]), int(sample_steps[win[-1]])],
            "median_grad_norm": _nanmedian(g[win])}


def _nanmedian(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else None


def _finding(rt, hits: dict, direction: str, threshold: float, context: dict, head: str,
             advice: str, reverse: bool) -> Finding:
    order = sorted(hits, key=lambda j: hits[j]["median"], reverse=reverse)
    names = [rt.param_names[j] for j in order]
    step = min(h["onset_step"] for h in hits.values())
    first = hits[order[0]]
    evidence = {
        "direction": direction,
        "threshold": threshold,
        **context,
        "median_ratio_by_parameter": {rt.param_names[j]: hits[j]["median"] for j in order[:20]},
        "onset_step_by_parameter": {rt.param_names[j]: hits[j]["onset_step"] for j in order[:20]},
        "median_grad_norm_by_parameter": {rt.param_names[j]: hits[j]["median_grad_norm"] for j in order[:20]},
        "window_steps": first["window_steps"],
    }
    side = "below" if direction == "too_small" else "above"
    others = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    if direction == "first_too_large":
        summary = (f"{head}: at step {step}, the run's first, ||dw||/||w|| of {names[0]}{others} was "
                   f"{first['median']:.3g}, {first['median'] / 1e-3:.3g}x the usual ~1e-3 ({len(names)} of "
                   f"{context['weights_judged']} weight tensors moved by {threshold:g}x their norm or more): the "
                   f"learning rate is far too high from the start.")
        return Finding(KIND, "warning", step, names, summary, evidence, advice)
    summary = (f"{head}: the median update-to-weight ratio ||dw||/||w|| of {names[0]}{others} is "
               f"{first['median']:.3g} over steps {first['window_steps'][0]}-{first['window_steps'][1]}, "
               f"{side} {threshold:g} (~1e-3 is usual; {len(names)} of {context['weights_judged']} "
               f"weight tensors), since step {step}.")
    row = int(np.clip(np.searchsorted(rt.step_index, step), 0, max(rt.n_steps - 1, 0)))
    lr_evidence, lr_clause = lr_context(rt, row) if rt.n_steps else ({}, "")
    evidence.update(lr_evidence)
    if lr_clause and direction == "too_large":
        summary = summary[:-1] + f"; it began {lr_clause}."
    return Finding(KIND, "warning", step, names, summary, evidence, advice)
