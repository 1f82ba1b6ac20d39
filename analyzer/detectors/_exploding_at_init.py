"""exploding_gradients present from the first steps, judged across depth (issue 22).

A network that explodes from its initialisation is its own normal: comparing the run with its
start finds nothing. What defines the pathology is how the signal changes through depth:

- Backward: each layer of a network in the chaotic regime (Poole et al. 2016, Schoenholz et al.
  2017), or a recurrent layer whose weights have a spectral radius above 1 (Pascanu et al. 2013),
  multiplies the gradient by a factor > 1 on its way to the input. The weight gradients' RMS of
  the first third of the layers of one kind is orders of magnitude above the last third's (the
  mirror of the vanishing detector), and the run does not train (its loss falls less than
  `trained_drop` x): healthy BatchNorm and LayerScale networks (MobileNetV2's depthwise stack,
  ConvNeXt) show such depth profiles while their loss falls 100x.
- Forward: weights drawn too large (std above He's sqrt(2/fan_in), He et al. 2015) multiply the
  activations by a gain > 1 per layer; the gradient of every layer then scales with that product
  while the ratio between layers stays ~1. Seen as the outputs of successive weighted layers
  growing geometrically on the first watched step.

Weighted layers are leaf modules owning a weight, less embeddings (an embedding table's gradient
is sparse, its RMS says nothing about depth) and normalisation layers (they reset the scale).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from ..findings import Finding
from ..trace import RankTrace
from ..trace.gradients import grad_rms

if TYPE_CHECKING:  # (exploding_gradients imports this module)
    from .exploding_gradients import ExplodingGradientsConfig

_NOT_DEPTH = ("Embedding", "Norm")  # module types skipped (EmbeddingBag, LayerNorm, BatchNorm2d...)


def weighted_layers(rt: RankTrace) -> list[tuple[str, list[int]]]:
    """(module, its weight parameters' columns) for the leaf modules owning a weight of 2+
    dimensions, in the model's definition order, less embeddings and normalisation layers."""
    types = dict(zip(rt.module_names, rt.module_types))
    leaves = {m for m, leaf in zip(rt.module_names, rt.module_is_leaf) if leaf}
    layers: dict[str, list[int]] = {}
    for j, (name, shape) in enumerate(zip(rt.param_names, rt.param_shapes)):
        module, _, leaf_name = name.rpartition(".")
        if len(shape) < 2 or not leaf_name.startswith("weight") or module not in leaves:
            continue
        if any(t in types.get(module, "") for t in _NOT_DEPTH):
            continue
        layers.setdefault(module, []).append(j)
    return list(layers.items())


def detect_at_init(rt: RankTrace, cfg: ExplodingGradientsConfig, advice: str, kind: str) -> list[Finding]:
    layers = weighted_layers(rt)
    if sum(len(js) for _, js in layers) < 3:
        return []
    found = _backward(rt, cfg, layers, advice, kind) or _forward(rt, cfg, layers, advice, kind)
    return found or _amplified(rt, cfg, advice, kind)


def _backward(rt, cfg, layers, advice, kind) -> list[Finding]:
    """Early layers' weight-gradient RMS >= depth_ratio x the late layers' of their kind, over the
    first steps, in a run that did not train anyway (its loss fell less than trained_drop x)."""
    n = min(cfg.depth_steps, rt.n_steps)
    if n < 1 or _trained(rt, cfg):
        return []
    found = None  # (ratio, cols, early, late, late median) of the kind of layer that grows most
    for cols in _comparable(rt, layers):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            g = rt.param_stat("grad_norm", rows=np.arange(n)).to_numpy(dtype=np.float64)[:, cols]
            rms = grad_rms(g, rt.param_numel[cols].astype(np.float64))
            rms[rms <= 0] = np.nan
            ok = ~np.isnan(rms).all(axis=1)
            if ok.sum() < n:
                return []  # a first step without gradients (or with NaNs) cannot be judged here
            med = np.nanmedian(rms[ok], axis=0)
        third = max(1, len(cols) // 3)
        early, late = med[:third], med[len(cols) - third:]
        late_med = float(np.nanmedian(late))
        if not (np.isfinite(late_med) and late_med > 0) or np.isnan(early).all():
            continue
        ratio = float(np.nanmax(early)) / late_med
        if ratio >= cfg.depth_ratio and (found is None or ratio > found[0]):
            found = (ratio, cols, early, late, late_med)
    if found is None:
        return []
    ratio, cols, early, late, late_med = found
    third = len(early)
    names = [rt.param_names[j] for j in cols]
    order = [k for k in np.argsort(-np.nan_to_num(early, nan=-1.0)) if early[k] >= cfg.depth_ratio * late_med]
    where = [names[k] for k in order[:3]]
    span = [int(rt.step_index[0]), int(rt.step_index[n - 1])]
    evidence = {
        "steps": span,
        "early_to_late_rms_ratio": ratio,
        "threshold_ratio": cfg.depth_ratio,
        "early_grad_rms": {names[k]: float(early[k]) for k in range(third)},
        "late_grad_rms": {names[len(cols) - third + k]: float(late[k]) for k in range(third)},
    }
    summary = (f"Gradients grow towards the input from the first step: the early layers' weight "
               f"gradients are {ratio:.3g}x the late layers' (RMS {float(np.nanmax(early)):.3g} in {where[0]} vs "
               f"median {late_med:.3g} in the last layers, steps {span[0]}-{span[1]}); each layer "
               f"multiplies the gradient on its way back, as in a network initialised in the chaotic "
               f"regime or a recurrent layer whose weights have a spectral radius above 1.")
    return [Finding(kind, "warning", span[0], where, summary, evidence, advice)]


def _amplified(rt, cfg, advice, kind) -> list[Finding]:
    """One layer that multiplies the signal by itself, with nothing to compare it to (a recurrent
    layer exploding through time inside one module, every weight's gradient alike): on the first
    watched step, a leaf module's output RMS is `amplification` x the largest RMS before it in the
    forward (the batch's included). A layer initialised as He et al. 2015 prescribe keeps its
    input's scale; a recurrent one of spectral radius above 1 multiplies it by that radius per
    time step (Pascanu et al. 2013). Not judged: the root, the last weighted layer (a regression
    head scales to its targets), normalisation layers (they reset the scale by design)."""
    first = _first_watched_rms(rt)
    if first is None:
        return []
    step, rms = first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        prior = float(np.hypot(rt.columns["input_mean"].to_numpy()[0], rt.columns["input_std"].to_numpy()[0]))
    prior = prior if np.isfinite(prior) and prior > 0 else 0.0
    owners = {name.rpartition(".")[0] for name in rt.param_names}
    leaves = [k for k, leaf in enumerate(rt.module_is_leaf) if leaf and k > 0]
    weighted = [k for k in leaves if rt.module_names[k] in owners]
    last = weighted[-1] if weighted else -1
    found = None  # (growth, module index, its input scale)
    for k in leaves:
        r = float(rms[k])
        if not np.isfinite(r) or r < 0:
            continue  # not called on the step, or already non-finite (nonfinite reports it)
        if k != last and prior > 0 and "Norm" not in rt.module_types[k] and r >= cfg.amplification * prior \
                and (found is None or r / prior > found[0]):
            found = (r / prior, k, prior)
        prior = max(prior, r)
    if found is None:
        return []
    growth, k, before = found
    name = rt.module_names[k]
    evidence = {"step": step, "amplification": growth, "threshold_amplification": cfg.amplification,
                "output_rms": {name: float(rms[k])}, "input_rms": before}
    summary = (f"{name} ({rt.module_types[k]}) amplifies the signal by itself from the first watched step (step "
               f"{step}): its output's RMS {rms[k]:.3g} is {growth:.3g}x the largest before it in the forward "
               f"({before:.3g}, the batch's included); as in a recurrent layer whose weights have a spectral "
               f"radius above 1, exploding through time, with no other layer to compare it to.")
    return [Finding(kind, "warning", step, [name], summary, evidence, advice)]


def _comparable(rt: RankTrace, layers: list[tuple[str, list[int]]]) -> list[list[int]]:
    """The weight columns in depth order, grouped by kind of layer: its module type, and for a
    convolution whether it is depthwise, pointwise (1x1) or spatial. Their gradients' scales
    differ by design (a depthwise kernel against a pointwise one; LayerScale's 1e-6 gain damps the
    layers inside a ConvNeXt block and not its stem or downsampling convolutions), so a kind is
    compared with itself, when it has 3 layers or more; a model with none such (a recurrent
    layer and its head) is judged over all its weighted layers."""
    types = dict(zip(rt.module_names, rt.module_types))
    groups: dict[str, list[int]] = {}
    for module, js in layers:
        for j in js:
            shape = rt.param_shapes[j]
            conv = "" if len(shape) < 3 else "depthwise" if shape[1] == 1 else \
                "pointwise" if int(np.prod(shape[2:])) == 1 else "spatial"
            groups.setdefault(f"{types.get(module, '')}:{conv}", []).append(j)
    for key in [k for k in groups if k.endswith(":depthwise") and len(groups[k]) < 3]:
        # (one input channel: a grayscale stem, not a depthwise stack)
        spatial = groups.setdefault(key.replace(":depthwise", ":spatial"), [])
        spatial[:] = sorted(spatial + groups.pop(key))
    kinds = [cols for cols in groups.values() if len(cols) >= 3]
    return kinds or [[j for _, js in layers for j in js]]


def _trained(rt: RankTrace, cfg) -> bool:
    """The loss fell trained_drop x or more from its first steps to the run's last tenth: the
    network trains, which a network in the chaotic regime does not (Schoenholz et al. 2017:
    past the edge of chaos, depth makes it untrainable)."""
    loss = rt.columns["loss"].to_numpy(dtype=np.float64)
    loss = loss[np.isfinite(loss)]
    if len(loss) < 2 * cfg.depth_steps:
        return False
    start, end = float(np.median(loss[:cfg.depth_steps])), float(np.median(loss[-max(cfg.depth_steps, len(loss) // 10):]))
    return start > 0 and end >= 0 and end * cfg.trained_drop <= start


def _first_watched_rms(rt) -> tuple[int, np.ndarray] | None:
    """(the first watched step, each module's output RMS on it: hypot of its mean and std), or
    None when no activations were sampled."""
    if rt.n_samples("activations") == 0:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = rt.activation_stat("mean", rows=[0])
        std = rt.activation_stat("std", rows=[0])
    return int(mean.index[0]), np.hypot(mean.to_numpy(dtype=np.float64)[0], std.to_numpy(dtype=np.float64)[0])


def _forward(rt, cfg, layers, advice, kind) -> list[Finding]:
    """Successive weighted layers' outputs growing >= activation_growth x over a chain of them,
    each at least `layer_gain` x the one before, on the first watched step."""
    first = _first_watched_rms(rt)
    if first is None:
        return []
    step, module_rms = first
    col = {m: k for k, m in enumerate(rt.module_names)}
    names = [m for m, _ in layers]
    rms = np.array([module_rms[col[m]] for m in names])
    best = None  # (growth, first, last) of the chain with the largest growth
    start = 0
    for k in range(1, len(rms) + 1):
        grows = k < len(rms) and np.isfinite(rms[k]) and rms[k - 1] > 0 and rms[k] >= cfg.layer_gain * rms[k - 1]
        if not grows:
            if k - 1 - start >= cfg.chain_layers - 1 and rms[start] > 0:
                growth = float(rms[k - 1] / rms[start])
                if best is None or growth > best[0]:
                    best = (growth, start, k - 1)
            start = k
    if best is None or best[0] < cfg.activation_growth:
        return []
    growth, a, b = best
    chain = names[a:b + 1]
    per_layer = growth ** (1.0 / (b - a))
    evidence = {
        "step": step,
        "activation_growth": growth,
        "threshold_growth": cfg.activation_growth,
        "gain_per_layer": per_layer,
        "output_rms": {m: float(rms[a + k]) for k, m in enumerate(chain)},
    }
    summary = (f"Activations explode through depth from the first watched step (step {step}): the "
               f"outputs of {len(chain)} successive layers grow {growth:.3g}x, from RMS {rms[a]:.3g} at "
               f"{chain[0]} to {rms[b]:.3g} at {chain[-1]} (a gain of {per_layer:.2g} per layer); every "
               f"gradient scales with that product, as with weights initialised too large.")
    return [Finding(kind, "warning", step, chain[:3], summary, evidence, advice)]
