"""The cases of make_samples.py about what units and heads do during training: dead_relu_lr
(ReLU units killed by the first large updates), dead_relu_cnn_init (conv blocks born dead from
a negative bias init), attention_entropy_lr (entropy collapse after a learning rate 30x too high)
and attention_sink_mask (a key padding mask that leaves every query only [CLS]). The dead shares
and entropies that fix their ground truth are measured during training on an unhooked twin of
the model (sample_truth.Twin).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from cases_common import _loss_summary, _train
from sample_lib import (PAD, EncoderClassifier, PaddedTransformer, SDPAAttention, batches, count_task, gratings,
                        ragged_count_task, relu_mlp, teacher_regression)
from sample_truth import (Twin, dead_share, lasting_onset, mha_entropy, read_trace, recorded_attention,
                          recorded_dead_share)

# ---------------------------------------------------------------------------------------------
# Dead units: a layer is dead when at least this share of its units output nothing positive on
# any example of the whole training set (the share the analyzer's warning uses, too: half a layer).
DEAD_SHARE = 0.5
# Attention entropy collapse: a layer's mean normalised entropy (entropy / log(keys), averaged over
# rows and heads) below this; 0.1 is close to one-hot (a row with 0.9 on one of 16 keys has 0.16).
COLLAPSED_ENTROPY = 0.1
# ---------------------------------------------------------------------------------------------


# -- dead ReLU units --------------------------------------------------------------------------------

def _dead_entry(case: str, shares: dict[str, list[float]], run_dir: str, extra: dict) -> dict:
    """shares: per module, the dead share measured at the start of every step (before its forward)."""
    onset = {m: lasting_onset(np.asarray(v) >= DEAD_SHARE) for m, v in shares.items()}
    dead = {m: s for m, s in onset.items() if s is not None}
    if not dead:
        raise SystemExit(f"{case}: no layer is {DEAD_SHARE:.0%} dead at the end: "
                         + ", ".join(f"{m} {v[-1]:.2f}" for m, v in shares.items()))
    step = min(dead.values())
    t = read_trace(run_dir)
    rec = recorded_dead_share(t)
    for m, v in shares.items():
        print(f"  {m}: dead share (whole training set) step 0 {v[0]:.2f}, max {max(v):.2f}, last {v[-1]:.2f}; "
              f">= {DEAD_SHARE:.0%} from step {onset[m]} on")
    print("  recorded dead share per window: " + "; ".join(f"{k} {v}" for k, v in rec.items()))
    return {"kind": "dead_relu", "step": step, "where": sorted(dead, key=list(shares).index), "evidence": {
        "dead_share_threshold": DEAD_SHARE,
        "onset_step_by_layer": onset,
        "dead_share_at_start": {m: round(v[0], 3) for m, v in shares.items()},
        "dead_share_at_end": {m: round(v[-1], 3) for m, v in shares.items()},
        "recorded_dead_share_per_window": rec,
        **extra,
    }}


def dead_relu_lr(run_dir: str) -> dict:
    """The ReLU MLP of exploding_lr, Adam at lr 0.1 (100x the usual 1e-3), no warm-up, 200 steps.
    The first updates overshoot (loss 1.2 -> ~30 at steps 2-3) and push the pre-activations of most
    units of fc2 (and later fc3) below zero for every input; those units get no gradient again. The
    loss recovers only to ~0.1-0.2 (healthy_mlp reaches 0.04)."""
    x, y = teacher_regression(seed=1)
    model = relu_mlp(seed=5)
    twin = Twin(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    b = batches(len(x), seed=2)
    names = ["relu1", "relu2", "relu3"]
    shares: dict[str, list[float]] = {n: [] for n in names}

    def measure(step):  # the weights this step's forward uses, on all 4096 training inputs
        for n, v in dead_share(twin.sync(), x, names).items():
            shares[n].append(v)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.mse_loss, opt, before_step=measure)
    return _dead_entry("dead_relu_lr", shares, run_dir, {"lr": 0.1, "optimizer": "Adam", **_loss_summary(run_dir)})


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class BlockCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = ConvBlock(1, 16)
        self.block2 = ConvBlock(16, 32)
        self.pool = nn.MaxPool2d(2)
        self.block3 = ConvBlock(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.block2(self.block1(x)))
        return self.head(self.block3(x).mean(dim=(2, 3)))


DEAD_INIT_BIAS = -0.25


def dead_relu_cnn_init(run_dir: str) -> dict:
    """A 3-block CNN whose blocks apply F.relu in their forward; an init helper, applied with
    model.apply(), sets every conv bias to DEAD_INIT_BIAS ("start sparse"). The third block's inputs
    (post-ReLU, pooled) are too small to overcome that bias anywhere: all its channels are dead from
    the first step, nothing reaches the head and the loss stays at ln 4. Adam 1e-3, 150 steps."""
    x, y = gratings(4096, seed=11)
    torch.manual_seed(0)
    model = BlockCNN()

    def init_sparse(m):
        if isinstance(m, nn.Conv2d):
            nn.init.constant_(m.bias, DEAD_INIT_BIAS)

    model.apply(init_sparse)
    twin = Twin(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(x), seed=2)
    names = ["block1", "block2", "block3"]
    shares: dict[str, list[float]] = {n: [] for n in names}

    def measure(step):  # whole training set, channels (dim 1) as units; at each window's start, and last
        if step in (0, 50, 100, 149):
            for n, v in dead_share(twin.sync(), x, names).items():
                shares[n].append(v)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 150, batch, F.cross_entropy, opt, before_step=measure)
    entry = _dead_entry("dead_relu_cnn_init", shares, run_dir,
                        {"conv_bias_init": DEAD_INIT_BIAS, "measured_at_steps": [0, 50, 100, 149], **_loss_summary(run_dir)})
    if entry["step"] != 0:
        raise SystemExit(f"dead_relu_cnn_init: expected dead from step 0, got {entry['step']}")
    return entry


# -- attention collapse -----------------------------------------------------------------------------

def attention_entropy_lr(run_dir: str) -> dict:
    """healthy_transformer's model and data, but Adam at lr 3e-2 (30x) without warm-up. The query and
    key weights of the first layer grow, its attention logits with them, and its attention entropy
    collapses to near one-hot (Zhai et al. 2023); the loss stalls at ~0.36 while the healthy run
    reaches 0.17."""
    tok, y = count_task(8192, seed=21, label_noise=0.05)
    torch.manual_seed(0)
    model = EncoderClassifier()
    twin = Twin(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    b = batches(len(tok), seed=22)
    probe = tok[:64]
    names = [f"encoder.layers.{i}.self_attn" for i in range(len(model.encoder.layers))]
    ent: dict[str, list[float]] = {n: [] for n in names}
    sink: dict[str, list[float]] = {n: [] for n in names}

    def measure(step):
        for n, (e, s) in zip(names, mha_entropy(twin.sync(), probe)):
            ent[n].append(float(e.mean()))
            sink[n].append(float(s.min()))

    def batch(step):
        idx = next(b)
        return (tok[idx],), y[idx]

    _train(model, run_dir, 300, batch, F.cross_entropy, opt, before_step=measure)
    onset = {n: lasting_onset(np.asarray(v) < COLLAPSED_ENTROPY) for n, v in ent.items()}
    where = [n for n in names if onset[n] is not None]
    if not where:
        raise SystemExit("attention_entropy_lr: no layer's entropy collapsed: "
                         + ", ".join(f"{n} {v[-1]:.3f}" for n, v in ent.items()))
    for n in names:
        v = ent[n]
        print(f"  {n}: mean normalised entropy (probe) step 0 {v[0]:.3f}, 50 {v[50]:.3f}, 100 {v[100]:.3f}, "
              f"last {v[-1]:.3f}; < {COLLAPSED_ENTROPY} from step {onset[n]} on; min sink share last {sink[n][-1]:.2f}")
    rec = recorded_attention(read_trace(run_dir))
    return {"kind": "attention_collapse", "step": min(onset[n] for n in where), "where": where, "evidence": {
        "collapse": "entropy", "threshold_mean_entropy": COLLAPSED_ENTROPY, "lr": 3e-2, "warmup_steps": 0,
        "onset_step_by_layer": onset,
        "probe_mean_entropy_every_10_steps": {n: [round(e, 4) for e in v[::10]] for n, v in ent.items()},
        "recorded": rec, **_loss_summary(run_dir),
    }}


CLS = 16


def attention_sink_mask(run_dir: str) -> dict:
    """A BERT-style classifier (a [CLS] token first, the output at [CLS] classifies) over
    variable-length sequences; 2 pre-LN blocks calling F.scaled_dot_product_attention with a key
    padding mask. The examples are stored as (1, L) tensors, the way a tokenizer called with
    return_tensors="pt" returns them, and the collate function takes their lengths with len(),
    which is 1 for every one of them: the mask leaves each query only key 0, [CLS]. Every head of
    every layer puts all its attention on [CLS] from the first step; [CLS] sees nothing but itself
    and the loss stays at the class prior. Adam 1e-3, 200 steps."""
    seqs, y = ragged_count_task(4096, seed=61)
    examples = [torch.cat([torch.tensor([CLS]), s])[None] for s in seqs]  # (1, L): tokenizer output
    torch.manual_seed(0)
    model = PaddedTransformer(SDPAAttention, pooling="cls", vocab=CLS + 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(examples), seed=62)
    allowed_keys = set()

    def batch(step):
        idx = next(b)
        ex = [examples[i] for i in idx]
        tok = pad_sequence([e[0] for e in ex], batch_first=True, padding_value=PAD)
        lengths = torch.tensor([len(e) for e in ex])  # the bug: len() of a (1, L) tensor is 1
        keep = torch.arange(tok.shape[1])[None] < lengths[:, None]
        allowed_keys.update(keep.sum(1).tolist())
        return (tok, keep), y[idx]

    _train(model, run_dir, 200, batch, F.cross_entropy, opt)
    where = [f"blocks.{i}.attn" for i in range(len(model.blocks))]
    rec = recorded_attention(read_trace(run_dir))
    prior = float(-(y.float().mean() * y.float().mean().log() + (1 - y.float().mean()) * (1 - y.float().mean()).log()))
    s = _loss_summary(run_dir)
    print(f"  keys each query may attend to, over all batches: {sorted(allowed_keys)}; loss "
          f"{s['loss_first_tenth_median']:.3f} -> {s['loss_last_tenth_median']:.3f} (class-prior entropy {prior:.3f})")
    if allowed_keys != {1}:
        raise SystemExit(f"attention_sink_mask: queries may attend to {sorted(allowed_keys)} keys")
    return {"kind": "attention_collapse", "step": 0, "where": where, "evidence": {
        "collapse": "sink", "key_position": 0, "allowed_keys_per_query": 1,
        "cause": "lengths = [len(e) for e in batch] on (1, L) tensors gives 1 for every example",
        "class_prior_entropy": round(prior, 4), "recorded": rec, **s,
    }}
