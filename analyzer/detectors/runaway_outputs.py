"""runaway_outputs: the model's outputs (logits) ran away in the steps before it went NaN/Inf.

A failure is often announced by the last layer: a learning rate too high or a bad batch pushes
its weights, its outputs grow by an order of magnitude within a few steps, and a softmax or a
hand-written log(softmax) then saturates or overflows (the logit growth PaLM's z-loss and
logit soft-capping exist to stop). Logits also grow in healthy training, slowly, as a
classifier grows confident: so this is judged only before a failure, against the outputs' own
recent level.

Definition: the failure is the first step whose loss or gradients went non-finite. The output
layer is the last leaf module with weights (less embeddings and norms), its max |output| read on
watched steps. If the largest of those in the `window` steps before the failure is at least
`ratio` x the median of the `baseline_samples` watched steps before that window, the outputs ran
away (warning), from the first of those steps that reached it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ._exploding_at_init import weighted_layers
from ..trace.losses import loss_series
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class RunawayOutputsConfig:
    # Before the first NaN/Inf: the output layer's max |output| over the `window` steps before
    # it at least `ratio` x (an order of magnitude) the median of the `baseline_samples` watched
    # steps before that (see detectors/runaway_outputs.py).
    ratio: float = 10.0
    window: int = 20
    baseline_samples: int = 5

    def __post_init__(self):
        _check(self, ratio=(1.0, None), window=(1, None), baseline_samples=(1, None))


class Evidence(BaseEvidence, total=False):
    layer: str  # the output layer: the last leaf module with weights
    output_absmax_before: float  # the median of its max |output| on the watched steps before the window
    output_absmax_peak: float  # the largest of it in the window before the failure
    growth: float  # peak / before (a ratio)
    threshold_ratio: float  # the growth judged a runaway (ratio)
    first_nonfinite_step: int  # the failure: the first step whose loss or gradients went NaN/Inf
    watched_steps: dict  # step -> the layer's max |output|, on the last watched steps before the failure


KIND = "runaway_outputs"
REQUIRES = ("modules/output_absmax",)
CONFIG = RunawayOutputsConfig  # its thresholds: a [runaway_outputs] table of analyze --config
ORDER = 100  # among findings of one step and stage, the detectors run (and list) in this order

ADVICE = (
    "The last layer's weights are being pushed hard: lower the learning rate (or add a warm-up) "
    "and clip the gradient norm; compute log-probabilities with F.log_softmax / F.cross_entropy, "
    "which do not overflow on large logits; in large models a z-loss or logit soft-capping keeps "
    "the logits bounded."
)


def detect(rt: RankTrace, cfg: RunawayOutputsConfig) -> list[Finding]:
    loss, real_nan = loss_series(rt)
    bad = np.flatnonzero(real_nan | np.isinf(loss) | rt.digest.grad_nonfinite)
    layers = weighted_layers(rt)
    if not bad.size or not layers:
        return []
    fail = int(bad[0])
    layer = layers[-1][0]
    col = rt.module_names.index(layer)
    watched = np.searchsorted(rt.step_index, rt.sample_steps("activations"))
    rows = np.unique(watched[watched < fail])
    if len(rows) < cfg.baseline_samples + 1:
        return []
    values = rt.module_rows(rows=rows).iloc[:, col].to_numpy(dtype=np.float64)  # (that column alone as float64)
    ok = np.isfinite(values) & (values >= 0)
    steps = rt.step_index[rows][ok]
    values = values[ok]
    fail_step = int(rt.step_index[fail])
    before = values[steps < fail_step - cfg.window][-cfg.baseline_samples:]
    recent = steps >= fail_step - cfg.window
    if len(before) < cfg.baseline_samples or not recent.any():
        return []
    level = float(np.median(before))
    peak = float(values[recent].max())
    if level <= 0 or peak < cfg.ratio * level:
        return []
    first = int(steps[recent][np.flatnonzero(values[recent] >= cfg.ratio * level)[0]])
    evidence = {
        "layer": layer,
        "output_absmax_before": level,
        "output_absmax_peak": peak,
        "growth": peak / level,
        "threshold_ratio": cfg.ratio,
        "first_nonfinite_step": fail_step,
        "watched_steps": {int(s): float(v) for s, v in zip(steps[-cfg.baseline_samples - 3:],
                                                           values[-cfg.baseline_samples - 3:])},
    }
    summary = (f"The outputs of {layer} ran away before the failure: their max |value| went from "
               f"{level:.3g} (median of the watched steps before) to {peak:.3g} ({peak / level:.3g}x), "
               f"from step {first}, {fail_step - first} step(s) before the first NaN/Inf at step {fail_step}.")
    return [Finding(KIND, "warning", first, [layer], summary, evidence, ADVICE)]
