"""Helpers of make_samples.py: the measurements that fix the ground truth of a case, and reading
a trace back with h5py (as any reader of the format would, without torchautopsy's analyzer).
The data sets and models are in sample_lib.py.

Measurements that look at the model during training (dead units, attention entropy) run on a
*twin*: a second instance of the same architecture that the recorder does not hook, loaded with
the trained model's weights (``Twin.sync``). Its forward passes are invisible to the recorder and
leave the training untouched (no RNG draws, no autograd graph, no change to the model).
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings

import h5py
import numpy as np
import torch
from torch import nn

from sample_lib import EncoderClassifier


class Twin:
    """An unhooked copy of a model for measurements during training. Make it before the Recorder
    hooks the model (a deep copy made later would copy the recorder's hooks too)."""

    def __init__(self, model: nn.Module):
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), \
            "make the Twin before Recorder(model, ...)"
        self.model = model
        self.twin = copy.deepcopy(model)

    @torch.no_grad()
    def sync(self) -> nn.Module:
        self.twin.load_state_dict(self.model.state_dict())
        self.twin.train(self.model.training)
        return self.twin


# -- measurements for the ground truth ----------------------------------------------------------

def lasting_onset(flags) -> int | None:
    """First index from which flags is True through the end, or None."""
    flags = np.asarray(flags, dtype=bool)
    if not flags.size or not flags[-1]:
        return None
    false = np.flatnonzero(~flags)
    return int(false[-1] + 1) if false.size else 0


@torch.no_grad()
def dead_share(model: nn.Module, x: torch.Tensor, names: list[str], unit_dim: int = 1) -> dict[str, float]:
    """For each named module of `model` (an unhooked twin) whose output is a ReLU's: the share of
    its units that output nothing positive on any example of x (a unit: a feature of a Linear
    output, a channel of a feature map)."""
    alive: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    handles = []
    for name in names:
        def hook(mod, args, out, name=name):
            dims = [d for d in range(out.dim()) if d != unit_dim]
            alive[name] = out.amax(dim=dims) > 0
        handles.append(mods[name].register_forward_hook(hook))
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return {n: 1.0 - alive[n].float().mean().item() for n in names}


@torch.no_grad()
def mha_entropy(model: EncoderClassifier, tok: torch.Tensor) -> list[np.ndarray]:
    """Per layer of an (unhooked) EncoderClassifier: each head's mean normalised row entropy
    (entropy / log(keys)) and the share of its attention mass on its most-attended key position,
    on the sequences `tok`: [(entropy[H], sink[H]) per layer]."""
    x = model.emb(tok) + model.pos
    out = []
    for layer in model.encoder.layers:
        _, w = layer.self_attn(x, x, x, need_weights=True, average_attn_weights=False)  # B,H,L,S
        ent = torch.special.entr(w).sum(-1) / math.log(w.shape[-1])
        mass = w.sum(dim=(0, 2))
        out.append((ent.mean(dim=(0, 2)).numpy(), (mass.amax(-1) / mass.sum(-1)).numpy()))
        x = layer(x)
    return out


# -- reading a trace back (h5py only) -------------------------------------------------------------

def _strings(ds) -> list[str]:
    return [s.decode() if isinstance(s, bytes) else str(s) for s in ds[()]]


def read_trace(run_dir: str) -> dict:
    with h5py.File(os.path.join(run_dir, "rank0.h5"), "r") as f:
        t = {
            "step": f["steps/step"][:],
            "loss": f["steps/loss"][:],
            "rss_bytes": f["steps/rss_bytes"][:],
            "live_tensors": f["steps/live_tensors"][:],
            "live_tensors_with_graph": f["steps/live_tensors_with_graph"][:],
            "live_tensor_bytes": f["steps/live_tensor_bytes"][:],
            "nonfinite_origin": f["steps/nonfinite_origin"][:],
            "batch_nonfinite": f["steps/batch_nonfinite"][:],
            "grad_norm": f["params/grad_norm"][:],
            "param_names": _strings(f["params/name"]),
            "param_shapes": [tuple(json.loads(s)) for s in _strings(f["params/shape"])],
            "numel": f["params/numel"][:],
            "module_names": _strings(f["modules/name"]),
            "module_types": _strings(f["modules/type"]),
            "attrs": dict(f.attrs),
        }
        if "activity_sites" in f and len(f["activity_sites/module"]):
            s = f["activity_sites"]
            t["activity_sites"] = [
                {"module": t["module_names"][int(m)], "function": fn, "call": int(c), "units": int(u),
                 "offset": int(o)}
                for m, fn, c, u, o in zip(s["module"][:], _strings(s["function"]), s["call"][:],
                                          s["units"][:], s["bit_offset"][:])]
            a = f["activity"]
            t["activity"] = {"step_start": a["step_start"][:], "step_end": a["step_end"][:],
                             "steps_seen": a["steps_seen"][:], "ever_positive": a["ever_positive"][:],
                             # watched steps per window (schema 2; every step before)
                             "steps_watched": a["steps_watched"][:] if "steps_watched" in a else
                             a["step_end"][:] - a["step_start"][:] + 1}
        if "attention_sites" in f and len(f["attention_sites/module"]):
            s = f["attention_sites"]
            t["attention_sites"] = [
                {"module": t["module_names"][int(m)], "source": src, "heads": int(h), "offset": int(o)}
                for m, src, h, o in zip(s["module"][:], _strings(s["source"]), s["heads"][:],
                                        s["head_offset"][:])]
            a = f["attention"]
            t["attention"] = {k: a[k][:] for k in ("step", "entropy", "max_weight", "sink_share",
                                                    "head_similarity", "keys")}
    return t


def recorded_dead_share(t: dict) -> dict[str, list[float]]:
    """Per activity site with units ("module:function#call"): the recorded share of units never
    positive in each window; None for a window without a watched step (nothing was seen)."""
    out = {}
    if "activity" not in t:
        return out
    bits = [np.unpackbits(row, bitorder="little").astype(bool) for row in t["activity"]["ever_positive"]]
    for s in t["activity_sites"]:
        if not s["units"]:
            continue
        key = f"{s['module']}:{s['function']}#{s['call']}"
        out[key] = [round(1.0 - float(b[s["offset"]:s["offset"] + s["units"]].mean()), 3) if w > 0 else None
                    for b, w in zip(bits, t["activity"]["steps_watched"])]
    return out


def recorded_attention(t: dict) -> dict[str, dict]:
    """Per attention site: the sampled steps, the layer's mean entropy, the smallest sink share
    over its heads and the largest max weight, per sample (as recorded)."""
    out = {}
    if "attention" not in t:
        return out
    a = t["attention"]
    for s in t["attention_sites"]:
        cols = slice(s["offset"], s["offset"] + s["heads"])
        with warnings.catch_warnings():  # rows with one allowed key have no entropy (NaN)
            warnings.simplefilter("ignore", RuntimeWarning)
            out[s["module"]] = {
                "steps": a["step"].tolist(),
                "mean_entropy": np.nanmean(a["entropy"][:, cols], axis=1).round(4).tolist(),
                "min_sink_share": np.nanmin(a["sink_share"][:, cols], axis=1).round(4).tolist(),
            }
    return out


EXPLODE_FACTOR = 100.0
EXPLODE_BASELINE_STEPS = 10


def explosion_truth(t: dict) -> dict:
    """The explosion as measured from the trace: the first step whose total gradient norm exceeds
    EXPLODE_FACTOR x the median of steps 0..EXPLODE_BASELINE_STEPS-1; the layer (parameters sharing
    a module prefix) whose gradient norm grew most at that step, relative to its own baseline."""
    names = t["param_names"]
    g = t["grad_norm"].astype(np.float64)
    total = np.sqrt(np.sum(g ** 2, axis=1))
    base = float(np.median(total[:EXPLODE_BASELINE_STEPS]))
    over = np.nonzero(total > EXPLODE_FACTOR * base)[0]  # NaN compares False, Inf True
    step = int(over[0]) if len(over) else None
    bad_loss = np.nonzero(~np.isfinite(t["loss"]))[0]
    nonfinite_step = int(bad_loss[0]) if len(bad_loss) else None
    if step is None:
        return {"step": None}
    layers = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names))  # in model order
    cols = {m: [i for i, n in enumerate(names) if n.rsplit(".", 1)[0] == m] for m in layers}
    layer_norm = {m: np.sqrt((g[:, c] ** 2).sum(axis=1)) for m, c in cols.items()}
    lgrowth = {m: float(v[step] / np.median(v[:EXPLODE_BASELINE_STEPS])) for m, v in layer_norm.items()}
    top = max(layers, key=lambda m: lgrowth[m])
    growth = g[step] / np.median(g[:EXPLODE_BASELINE_STEPS], axis=0)
    hit = np.nonzero(t["nonfinite_origin"] >= 0)[0]
    origin_step = int(hit[0]) if len(hit) else None
    origin = t["module_names"][t["nonfinite_origin"][origin_step]] if len(hit) else None
    return {
        "step": step, "where": [names[i] for i in cols[top]], "total": total, "base": base,
        "nonfinite_step": nonfinite_step, "origin_step": origin_step, "origin": origin,
        "layer_growth": lgrowth, "param_growth": dict(zip(names, growth.tolist())),
    }


def rss_growth(t: dict) -> dict:
    """Straight-line fit of the resident memory over the run: MiB per step, from and to."""
    rss = t["rss_bytes"].astype(np.float64) / 2 ** 20
    steps = t["step"].astype(np.float64)
    slope, icpt = np.polyfit(steps, rss, 1)
    fit = slope * steps + icpt
    r2 = 1 - ((rss - fit) ** 2).sum() / ((rss - rss.mean()) ** 2).sum()
    return {"mib_per_step": round(float(slope), 3), "r2": round(float(r2), 4),
            "rss_mib_first": round(float(rss[0]), 1), "rss_mib_last": round(float(rss[-1]), 1)}


def census(t: dict) -> list[list[int]]:
    """The live-tensor census samples: [step, tensors, tensors holding a graph, MiB]."""
    sel = t["live_tensors"] >= 0
    return [[int(s), int(n), int(g), round(float(b) / 2 ** 20, 1)] for s, n, g, b in
            zip(t["step"][sel], t["live_tensors"][sel], t["live_tensors_with_graph"][sel],
                t["live_tensor_bytes"][sel])]
