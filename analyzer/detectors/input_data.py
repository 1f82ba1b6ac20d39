"""input_data: the batch is not what the model expects, from its statistics as the model received
it (steps/input_*: recorder/forward/input_stats.py).

- ``unnormalized`` (warning): the batch's typical standard deviation or mean, over the first
  ``first_steps`` steps, at least ``max_scale`` (0..255 images: std ~60; raw units). The
  usual initialisations (Kaiming, Glorot, PyTorch's defaults) assume inputs of about unit
  variance, and LeCun et al. 1998, "Efficient BackProp" sec. 4.3, asks for zero mean and unit
  variance; 10x off is a first layer 10x (100x in variance) off its intended scale.
- ``feature_scales`` (warning): on watched steps, the features of a 2-D batch differ in
  standard deviation by at least ``max_feature_ratio`` (a price in dollars beside a ratio):
  the large ones dominate the first layer (LeCun et al. sec. 4.3: equalise the covariances).
- ``constant_batch`` (warning): a batch whose every element is the same (all zeros: a reader
  that returned nothing, a blank shard), on ``min_constant`` steps or more.
- ``shift`` (warning): mid-run the batch's mean moved by at least ``shift_stds`` of its own
  within-batch standard deviations, or its standard deviation changed ``shift_ratio``-fold, and
  stayed so for ``window`` steps: a data-pipeline change, a shard in other units, a
  normalisation switched off. Dated at its first step.
- ``constant_features`` (info): features that never vary over a batch on any watched step.

Integer inputs (token ids) have no statistics and are not judged. A NaN in the batch is
``nonfinite``'s (stage "batch").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class InputDataConfig:
    first_steps: int = 20  # the steps whose median judges the scale
    max_scale: float = 10.0  # a typical std or |mean| this large: not normalised
    max_feature_ratio: float = 1000.0  # the largest feature std over the smallest non-zero one
    min_constant: int = 1  # constant batches (every element the same) to report
    window: int = 20  # steps before and after a shift, both sides this long
    shift_stds: float = 1.0  # the mean's move, in the earlier steps' within-batch stds
    shift_ratio: float = 3.0  # the std's change, either way
    shift_share: float = 0.8  # of the steps after (and no more than 1 - this of those before)

    def __post_init__(self):
        _check(self, first_steps=(1, None), max_scale=(0.0, None), max_feature_ratio=(1.0, None),
               min_constant=(1, None), window=(2, None), shift_stds=(0.0, None), shift_ratio=(1.0, None),
               shift_share=(0.5, 1.0))


class Evidence(BaseEvidence, total=False):
    cause: str  # unnormalized | feature_scales | constant_batch | shift | constant_features
    mean: float  # unnormalized: the batch's median mean over the first steps
    std: float  # ... and its median std
    min: float  # ... the smallest value seen in them
    max: float  # ... and the largest
    feature_std_ratio: float  # feature_scales: the median over watched steps of the largest feature std / smallest
    constant_steps: list  # constant_batch: the steps (the first 20)
    n_constant_steps: int
    constant_value: float  # ... the value every element held (at the first)
    before: dict  # shift: {"mean", "std"} medians over the window before
    after: dict  # ... and after
    constant_features: int  # constant_features: how many, at the last watched step
    threshold: float  # the threshold the cause's figure crossed


KIND = "input_data"
REQUIRES = ("steps/input_mean", "steps/input_std")
CONFIG = InputDataConfig
ORDER = 12

ADVICE = {
    "unnormalized": "Normalise the inputs to about zero mean and unit variance (images: divide by 255 and "
                    "subtract the dataset's mean / divide by its std, torchvision's Normalize; features: "
                    "standardise with the training set's statistics).",
    "feature_scales": "Standardise each feature (subtract its mean, divide by its std, computed on the training "
                      "set): features in other units (a price beside a ratio) dominate the first layer.",
    "constant_batch": "Check the data pipeline at these steps: a batch whose every element is the same carries "
                      "nothing (an empty read, a blank or unfinished shard, a failed decode filled with zeros).",
    "shift": "Something in the data changed at this step: check the pipeline (a new shard, other units, a "
             "normalisation switched off, an augmentation schedule) and the data of that step.",
    "constant_features": "Features that never vary carry no information: check the columns the pipeline fills "
                         "(a failed join, a default value).",
}


def detect(rt: RankTrace, cfg: InputDataConfig) -> list[Finding]:
    c = rt.columns
    mean, std = c["input_mean"].to_numpy(np.float64), c["input_std"].to_numpy(np.float64)
    measured = np.isfinite(mean) & np.isfinite(std)
    if not measured.any():
        return []
    steps = rt.step_index
    lo, hi = c["input_min"].to_numpy(np.float64), c["input_max"].to_numpy(np.float64)
    out = []
    first = np.flatnonzero(measured)[:cfg.first_steps]
    m, s = float(np.median(mean[first])), float(np.median(std[first]))
    if max(abs(m), s) >= cfg.max_scale:
        ev = {"cause": "unnormalized", "mean": m, "std": s, "min": float(np.min(lo[first])),
              "max": float(np.max(hi[first])), "threshold": cfg.max_scale}
        out.append(_finding("warning", int(steps[first[0]]), ev,
                            f"The inputs are not normalised: over the first {len(first)} steps the batch's values "
                            f"run {ev['min']:.4g} to {ev['max']:.4g}, mean {m:.4g}, std {s:.4g} (about 0 and 1 "
                            f"expected)."))
    ratio = c["input_std_ratio"].to_numpy(np.float64)
    ratio = ratio[np.isfinite(ratio)]
    if len(ratio) and float(np.median(ratio)) >= cfg.max_feature_ratio:
        r = float(np.median(ratio))
        ev = {"cause": "feature_scales", "feature_std_ratio": r, "threshold": cfg.max_feature_ratio}
        out.append(_finding("warning", int(steps[first[0]]), ev,
                            f"The input features have wildly different scales: the largest feature's std is {r:.3g}x "
                            "the smallest's (median over the watched steps)."))
    const = np.flatnonzero(measured & (std == 0))
    if len(const) >= cfg.min_constant:
        value = float(lo[const[0]])
        ev = {"cause": "constant_batch", "constant_steps": [int(steps[i]) for i in const[:20]],
              "n_constant_steps": int(len(const)), "constant_value": value}
        what = "all zeros" if value == 0 else f"every element {value:.4g}"
        out.append(_finding("warning", int(steps[const[0]]), ev,
                            f"{len(const):,} batch{'es were' if len(const) > 1 else ' was'} constant ({what}), first "
                            f"at step {int(steps[const[0]]):,}: the model learned nothing from "
                            f"{'them' if len(const) > 1 else 'it'}."))
    shift = _shift(mean, std, measured, cfg)
    if shift is not None:
        i, before, after = shift
        ev = {"cause": "shift", "before": before, "after": after}
        out.append(_finding("warning", int(steps[i]), ev,
                            f"The inputs changed at step {int(steps[i]):,}: batch mean {before['mean']:.4g} -> "
                            f"{after['mean']:.4g}, std {before['std']:.4g} -> {after['std']:.4g} (medians over "
                            f"{cfg.window} steps each side), and stayed so."))
    feats = c["input_constant_features"].to_numpy()
    watched = feats[feats >= 0]
    if len(watched) and (watched > 0).all():
        ev = {"cause": "constant_features", "constant_features": int(watched[-1])}
        out.append(_finding("info", None, ev,
                            f"{int(watched[-1]):,} input feature(s) held the same value in every sample of every "
                            "watched batch."))
    return out


def _shift(mean, std, measured, cfg) -> tuple[int, dict, dict] | None:
    """(row, before, after) of the first lasting change of the batch's mean or std, or None. The
    medians of the ``window`` steps before and after each step (rolling: a million steps in
    well under a second) find it; its first step is then the first that is off and stays off."""
    idx = np.flatnonzero(measured)
    w = cfg.window
    if len(idx) < 2 * w:
        return None
    m, s = pd.Series(mean[idx]), pd.Series(std[idx])
    bm, bs = m.rolling(w).median().shift(1).to_numpy(), s.rolling(w).median().shift(1).to_numpy()
    am, as_ = m[::-1].rolling(w).median()[::-1].to_numpy(), s[::-1].rolling(w).median()[::-1].to_numpy()
    with np.errstate(invalid="ignore"):
        cond = (bs > 0) & ((np.abs(am - bm) >= cfg.shift_stds * bs) | (as_ >= cfg.shift_ratio * bs)
                           | (as_ <= bs / cfg.shift_ratio))
    hits = np.flatnonzero(cond)
    if not len(hits):
        return None
    k0 = int(hits[0])
    base_m, base_s = float(bm[k0]), float(bs[k0])
    mv, sv = m.to_numpy(), s.to_numpy()
    off = (np.abs(mv - base_m) >= cfg.shift_stds * base_s) | (sv >= cfg.shift_ratio * base_s) | \
        (sv <= base_s / cfg.shift_ratio)
    onset = next((j for j in range(k0, min(k0 + w, len(off))) if off[j] and off[j:j + w].mean() >= cfg.shift_share),
                 None)
    if onset is None or off[max(0, onset - w):onset].mean() > 1 - cfg.shift_share:
        return None
    return int(idx[onset]), {"mean": base_m, "std": base_s}, \
        {"mean": float(np.median(mv[onset:onset + w])), "std": float(np.median(sv[onset:onset + w]))}


def _finding(severity: str, step, ev: dict, summary: str) -> Finding:
    return Finding(KIND, severity, step, [""], summary, ev, ADVICE[ev["cause"]])
