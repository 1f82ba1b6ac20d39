"""Helpers of make_samples.py: synthetic data sets, the small models, reading a trace back with h5py
(as any reader of the format would, without torchautopsy's analyzer), and the measurements that
fix the ground truth of a case.

Everything random takes an explicit seed: data through its own ``torch.Generator``, initial weights
through ``torch.manual_seed`` right before the model is built.

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
from collections import OrderedDict

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

N_IN = 16
BATCH = 64


# -- data ---------------------------------------------------------------------------------------

def teacher_regression(seed: int, n: int = 4096):
    """Inputs x ~ N(0, 1) and targets y = teacher(x) + noise, standardised (a learnable task
    with a noise floor, so the loss flattens out rather than going to zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_IN, generator=g)
    torch.manual_seed(seed + 1000)
    teacher = nn.Sequential(nn.Linear(N_IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        y = teacher(x)
        y = (y - y.mean()) / y.std()
    y = y + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def batches(n: int, seed: int, batch: int = BATCH):
    """Mini-batches of indices drawn uniformly (with replacement), from their own generator."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, n, (batch,), generator=g)


def gratings(n: int, seed: int, size: int = 16, noise: float = 0.5, raw: bool = False):
    """n grey images (1 x size x size) of sinusoidal gratings; the class (0-3) is the orientation
    (0, 45, 90, 135 degrees, +-9 degrees of jitter), with random spatial frequency and phase, plus
    Gaussian pixel noise. Standardised over the data set, or with raw=True pixel values in [0, 1]
    (as decoded from 8-bit images: (value + 3) / 6 clipped)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    theta = y.float() * (math.pi / 4) + 0.15 * torch.randn(n, generator=g)
    freq = 0.25 + 0.35 * torch.rand(n, generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g)
    c = torch.arange(size).float() - (size - 1) / 2
    yy, xx = torch.meshgrid(c, c, indexing="ij")
    proj = xx[None] * torch.cos(theta)[:, None, None] + yy[None] * torch.sin(theta)[:, None, None]
    img = torch.sin(freq[:, None, None] * proj + phase[:, None, None])[:, None]
    x = img + noise * torch.randn(n, 1, size, size, generator=g)
    if raw:
        return ((x + 3) / 6).clamp(0, 1), y
    return (x - x.mean()) / x.std(), y


PAD = 0


def count_task(n: int, seed: int, length: int = 16, vocab: int = 16, label_noise: float = 0.0):
    """Token sequences (ids 1..vocab-1, uniform); label 1 if token 1 occurs more often than token 2.
    A share `label_noise` of the labels is flipped (annotation noise: the loss has a floor)."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(1, vocab, (n, length), generator=g)
    y = ((tok == 1).sum(1) > (tok == 2).sum(1)).long()
    flip = torch.rand(n, generator=g) < label_noise
    return tok, torch.where(flip, 1 - y, y)


def ragged_count_task(n: int, seed: int, max_len: int = 16, vocab: int = 16, min_len: int = 4):
    """The count task on sequences of random length (min_len..max_len): a list of 1-D token tensors."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    seqs = [torch.randint(1, vocab, (int(L),), generator=g) for L in lengths]
    y = torch.tensor([int((s == 1).sum() > (s == 2).sum()) for s in seqs])
    return seqs, y


def waves(n: int, seed: int, length: int = 50):
    """Noisy sine waves (n x length x 1); the class (0-3) is the frequency (2, 3, 4 or 5 cycles per
    sequence), with random phase and amplitude (0.5-1.5) and Gaussian noise of std 0.5."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    t = torch.arange(length).float() / length
    amp = 0.5 + torch.rand(n, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    x = amp * torch.sin(2 * math.pi * (y[:, None].float() + 2) * t + phase)
    x = x + 0.5 * torch.randn(n, length, generator=g)
    return x[..., None], y


# -- models -------------------------------------------------------------------------------------

def relu_mlp(seed: int, width: int = 64, n_in: int = N_IN) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(
        fc1=nn.Linear(n_in, width), relu1=nn.ReLU(),
        fc2=nn.Linear(width, width), relu2=nn.ReLU(),
        fc3=nn.Linear(width, width), relu3=nn.ReLU(),
        out=nn.Linear(width, 1),
    ))


def small_cnn(seed: int, batchnorm: bool) -> nn.Module:
    """conv-(BN)-ReLU x4 with one max-pool, global average pooling, a linear 4-class head."""
    torch.manual_seed(seed)
    layers, c_in = [], 1
    for i, c in enumerate((16, 16, 32, 32), start=1):
        layers.append((f"conv{i}", nn.Conv2d(c_in, c, 3, padding=1, bias=not batchnorm)))
        if batchnorm:
            layers.append((f"bn{i}", nn.BatchNorm2d(c)))
        layers.append((f"relu{i}", nn.ReLU()))
        if i == 2:
            layers.append(("pool", nn.MaxPool2d(2)))
        c_in = c
    layers += [("gap", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()), ("fc", nn.Linear(c_in, 4))]
    return nn.Sequential(OrderedDict(layers))


class EncoderClassifier(nn.Module):
    """Token + learned position embeddings, nn.TransformerEncoder (post-LN, PyTorch's default),
    mean pooling over positions, a linear head."""

    def __init__(self, vocab: int = 16, length: int = 16, d: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(length, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(tok) + self.pos).mean(1))


class HandwrittenAttention(nn.Module):
    """Multi-head self-attention written out by hand, as many research code bases do: padded keys
    get a score of -inf before the softmax."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.heads)
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


class SDPAAttention(HandwrittenAttention):
    """The same attention through torch.nn.functional.scaled_dot_product_attention (bool mask,
    True = may attend)."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)) (GELU MLP)."""

    def __init__(self, d: int, heads: int, attention: type):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), keep)
        return x + self.mlp(self.ln2(x))


class PaddedTransformer(nn.Module):
    """Classifier over padded token sequences (PAD = 0) with a key padding mask `keep` (True =
    real token). pooling "mean": mean over the real tokens; "cls": the output at position 0."""

    def __init__(self, attention: type, pooling: str, vocab: int = 16, max_len: int = 17, d: int = 32,
                 heads: int = 4, layers: int = 2):
        super().__init__()
        self.pooling = pooling
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Parameter(0.1 * torch.randn(max_len, d))
        self.blocks = nn.ModuleList(Block(d, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tok: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok) + self.pos[: tok.shape[1]]
        for block in self.blocks:
            x = block(x, keep)
        x = self.ln_f(x)
        if self.pooling == "cls":
            return self.head(x[:, 0])
        k = keep[..., None].to(x.dtype)
        return self.head((x * k).sum(1) / k.sum(1).clamp(min=1.0))


class GRUClassifier(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


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
