"""attention_collapse: attention heads degenerate.

Data: per attention layer (nn.MultiheadAttention, or the module that called
F.scaled_dot_product_attention) and head, on sampled steps: mean normalised row entropy, mean
largest weight, share of mass on the single most-attended key, and the mean pairwise cosine
similarity of the heads' maps. Three collapses, each judged per layer on the last
`min_samples` samples and dated from the first sample after which it held to the end:

- entropy collapse (Zhai et al. 2023): the layer's mean entropy under `entropy` (normalised by
  the keys each row may attend to), from the first step on as well: a randomly initialised head
  is never meant to be one-hot, so a layer near one-hot at step 0 is a broken initialisation
  (query/key weights too large, a softmax scale missing), not a design;
- all mass on one position: every head's sink share above `sink_share`;
- heads alike: similarity above `similarity` while the layer is sharp (mean entropy below
  `alike_entropy`); near-uniform heads at initialisation are alike without being collapsed.
"""

from __future__ import annotations

from dataclasses import dataclass

import warnings

import numpy as np
import pandas as pd

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace


@dataclass(frozen=True)
class AttentionCollapseConfig:
    # Entropy collapse (Zhai et al. 2023, "Stabilizing Transformer Training by Preventing
    # Attention Entropy Collapse"): a layer's mean normalised row entropy below this. Single
    # low-entropy heads are often healthy specialists (previous-token heads), so the layer's
    # mean is judged, from the first sampled step on (near one-hot at initialisation is broken).
    entropy: float = 0.1
    # All mass on one key position: every head of the layer puts more than this share of its
    # attention on its single most-attended key (healthy heads with a sink stay below; the
    # StreamingLLM sink heads put ~50-80% there).
    sink_share: float = 0.95
    # Heads alike: mean pairwise cosine similarity of the heads' maps above this while the
    # layer is also sharp (mean entropy below `alike_entropy`); at initialisation every head is
    # near-uniform and therefore alike, which is not a collapse.
    similarity: float = 0.99
    alike_entropy: float = 0.5
    # The condition must hold on the last this-many sampled steps.
    min_samples: int = 2


class Evidence(BaseEvidence, total=False):
    collapse: str  # which collapse: "entropy", "sink" (all mass on one key) or "alike" (heads alike)
    source: str  # how the layer was seen: an nn.MultiheadAttention, or an F.scaled_dot_product_attention call
    heads: int  # the layer's attention heads
    keys: int  # the key positions a query row could attend to, at the last sampled step
    entropy_per_head_at_end: list  # per head, its mean normalised row entropy at the last sample (0: one-hot, 1: uniform)
    entropy_mean_at_first_sample: float  # the heads' mean of it at the first sample (0..1)
    sink_share_per_head_at_end: list  # per head, its share of attention on its most-attended key (0..1)
    max_weight_per_head_at_end: list  # per head, its mean largest attention weight (0..1)
    head_similarity_at_end: float  # mean pairwise cosine similarity of the heads' maps (0..1)
    sampled_steps: list  # [first, last] sampled step


KIND = "attention_collapse"
REQUIRES = ("attention/entropy", "attention_sites/heads")
CONFIG = AttentionCollapseConfig  # its thresholds: a [attention_collapse] table of analyze --config
ORDER = 50  # among findings of one step and stage, the detectors run (and list) in this order

_ADVICE = {
    "entropy": "Entropy collapse usually follows attention logits that grow too large: lower the "
               "learning rate or add a warm-up, use QK-LayerNorm or sigma-reparametrisation of the "
               "query/key projections (Zhai et al. 2023), and check the softmax scale (1/sqrt(d_head)).",
    "sink": "All heads attending to one position: check the attention mask and padding (a mask that "
            "leaves one key visible), positional encodings, and whether the inputs at that position "
            "dominate (a huge norm at a BOS/CLS token); lower the learning rate.",
    "alike": "Heads that compute the same sharp pattern waste capacity (rank collapse): check that "
             "the heads' projections are initialised independently, lower the learning rate, and "
             "consider fewer heads or dropout on attention.",
}


def detect(rt: RankTrace, cfg: AttentionCollapseConfig) -> list[Finding]:
    sites = rt.attention_sites
    if len(sites) == 0:
        return []
    stats = _Stats(*(rt.attention_stat(s) for s in ("entropy", "sink_share", "max_weight", "head_similarity")))
    steps = stats.entropy.index.to_numpy()
    if len(steps) < cfg.min_samples:
        return []
    findings = []
    for j, site in enumerate(sites.itertuples()):
        layer = _layer(stats, j, site)
        for how, cond in _conditions(layer, int(site.heads), cfg).items():
            begin = _holds_to_end(cond, cfg.min_samples)
            if begin is None:
                continue
            findings.append(Finding(KIND, "warning", int(steps[begin]), [site.module],
                                    _summary(how, layer, site, steps, begin, cfg),
                                    _evidence(how, layer, site, rt, j, steps), _ADVICE[how]))
    return findings


@dataclass(frozen=True)
class _Stats:
    """The attention statistics, sampled steps x (head or layer) columns."""

    entropy: pd.DataFrame
    sink: pd.DataFrame
    max_weight: pd.DataFrame
    similarity: pd.DataFrame


@dataclass(frozen=True)
class _Layer:
    """One attention layer's statistics, sampled steps x its heads."""

    entropy: np.ndarray  # normalised row entropy per head
    sink: np.ndarray  # share of attention on the single most-attended key, per head
    max_weight: np.ndarray  # mean largest weight, per head
    similarity: np.ndarray  # the heads' mean pairwise cosine similarity, per step
    mean_entropy: np.ndarray  # the heads' mean entropy, per step


def _layer(stats: _Stats, j: int, site) -> _Layer:
    cols = list(range(int(site.head_offset), int(site.head_offset + site.heads)))
    ent = stats.entropy.iloc[:, cols].to_numpy(dtype=float)
    with warnings.catch_warnings():  # rows with every head NaN (one allowed key) give NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_ent = np.nanmean(ent, axis=1) if ent.size else np.full(len(stats.entropy.index), np.nan)
    return _Layer(ent, stats.sink.iloc[:, cols].to_numpy(dtype=float),
                  stats.max_weight.iloc[:, cols].to_numpy(dtype=float),
                  stats.similarity.iloc[:, j].to_numpy(dtype=float), mean_ent)


def _conditions(layer: _Layer, heads: int, cfg: AttentionCollapseConfig) -> dict[str, np.ndarray]:
    """Per collapse, per sampled step: whether the layer was collapsed that way."""
    return {
        "entropy": layer.mean_entropy < cfg.entropy,
        "sink": np.all(layer.sink > cfg.sink_share, axis=1) & ~np.isnan(layer.sink).all(axis=1),
        "alike": (layer.similarity > cfg.similarity) & (layer.mean_entropy < cfg.alike_entropy) & (heads > 1),
    }


def _summary(how: str, layer: _Layer, site, steps: np.ndarray, begin: int, cfg: AttentionCollapseConfig) -> str:
    last = len(steps) - 1
    name = site.module or "(model)"
    if how == "entropy":
        low = [h for h in range(int(site.heads)) if layer.entropy[last, h] < cfg.entropy]
        return (f"Attention entropy of {name} collapsed: mean normalised entropy "
                f"{layer.mean_entropy[last]:.3f} over its {int(site.heads)} heads at step {steps[last]} "
                f"(threshold {cfg.entropy:g}), since step {steps[begin]}; heads {low} are near one-hot.")
    if how == "sink":
        return (f"Every head of {name} puts over {cfg.sink_share:.0%} of its attention on a "
                f"single key position since step {steps[begin]} (sink share "
                f"{np.nanmin(layer.sink[last]):.3f}-{np.nanmax(layer.sink[last]):.3f} at step {steps[last]}).")
    return (f"The {int(site.heads)} heads of {name} compute the same sharp pattern since "
            f"step {steps[begin]}: similarity {layer.similarity[last]:.4f}, mean entropy "
            f"{layer.mean_entropy[last]:.3f}.")


def _evidence(how: str, layer: _Layer, site, rt: RankTrace, j: int, steps: np.ndarray) -> Evidence:
    last = len(steps) - 1
    return {
        "collapse": how,
        "source": site.source,
        "heads": int(site.heads),
        "keys": int(rt.attention_stat("keys").iloc[last, j]),
        "entropy_per_head_at_end": [float(x) for x in layer.entropy[last]],
        "entropy_mean_at_first_sample": float(layer.mean_entropy[0]),
        "sink_share_per_head_at_end": [float(x) for x in layer.sink[last]],
        "max_weight_per_head_at_end": [float(x) for x in layer.max_weight[last]],
        "head_similarity_at_end": float(layer.similarity[last]),
        "sampled_steps": [int(steps[0]), int(steps[last])],
    }


def _holds_to_end(cond: np.ndarray, min_samples: int) -> int | None:
    """First index from which cond is True through the last sample, if that is >= min_samples."""
    if cond.size < min_samples or not cond[-min_samples:].all():
        return None
    false = np.flatnonzero(~cond)
    return int(false[-1] + 1) if false.size else 0

