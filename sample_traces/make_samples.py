"""Make the sample traces: small, real training runs, healthy and broken, recorded by torchautopsy.

    python sample_traces/make_samples.py [--out DIR] [--jobs N] [CASE ...]

Every case trains a small model on synthetic data generated here (no downloads) with the recorder
on (default options), and writes ``DIR/<case>/rank0.h5`` (DIR defaults to the folder of this
script). With no CASE, all cases run. The ground truth of every case goes to ``DIR/expected.json``
(case -> {"kind", "step", "where", "evidence"}); running a subset of cases updates only their entries.

Nothing is faked: each failure arises the way it does in real training, from the data, the
architecture or the hyper-parameters, and the numbers in the trace are what the recorder saw.

Each case runs in a process of its own (forked from this one, or spawned where fork is not
available), so that its memory readings and its allocator state do not depend on which cases ran
before it; with --jobs 2 two cases run side by side. Torch runs on one thread in each (on a shared
2-core machine, two threads per tiny model cost 10-20x more time than one, measured).

Everything is seeded (torch.manual_seed for the initial weights, torch.Generator for data and
batch order), so the same torch version on the same machine writes the same losses, bit for bit.
The losses are also bit-identical to the same loops without the recorder: the measurements that
fix a case's ground truth during training run on an unhooked twin of the model (sample_lib.Twin).
The script checks each trace after writing it (h5py only) and prints what it found; it exits
non-zero if a case did not come out as intended.

Cases (architecture; what goes wrong; how the ground truth "step" and "where" are fixed). The
README has the full table.

healthy_mlp, healthy_cnn_bn, healthy_transformer, healthy_gru, healthy_plateau
    Nothing goes wrong (the last one's loss flattens at its noise floor). kind: null.
exploding_lr (MLP), exploding_cnn (CNN without normalisation)
    A learning rate too high for the network. step: the first step whose total gradient norm
    exceeds 100x the median of steps 0-9 (measured from the trace); where: the parameters of the
    layer whose gradient norm grew most at that step, relative to its own steps 0-9.
vanishing_sigmoid (12-layer sigmoid MLP), vanishing_cnn_sigmoid (8-conv sigmoid CNN)
    Sigmoid derivatives (<= 1/4) compound over depth. step 0 (from initialisation on);
    where: the first layer's weight and bias.
nan_birth (MLP), nan_cnn_std (CNN), nan_attention_mask (transformer), nan_backward_sqrt (Siamese MLP)
    A bad record reaches an operation that is undefined on it. step: the step whose batch holds the
    record (by construction); where: the module whose forward holds the operation (by
    construction; checked against steps/nonfinite_origin), or for nan_backward_sqrt, whose forward
    stays finite, the parameters the backward pass reaches first.
dead_relu_lr (MLP), dead_relu_cnn_init (CNN, F.relu inside forward)
    ReLU units killed by the first large updates / born dead. step and where: measured on the
    whole training set with an unhooked twin of the model (see the functions).
attention_entropy_lr (nn.TransformerEncoder), attention_sink_mask (F.scaled_dot_product_attention)
    Entropy collapse after a learning rate 30x too high without warm-up; a key padding mask that
    leaves every query one key. step and where: measured with the twin / by construction.
leak_losses_mlp (MLP), leak_hook_gru (GRU)
    The training loop keeps every step's graph; a forward hook keeps every step's GRU outputs.
    step 0 (from the first iteration on, by construction).
oom_pairwise_mlp (MLP)
    A periodic retrieval metric builds an all-pairs tensor over a 2**20-item feature bank: the CPU
    allocator refuses the request and the job dies. step: the step it ran in (by construction).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sample_lib import (BATCH, EXPLODE_BASELINE_STEPS, EXPLODE_FACTOR, N_IN, PAD, EncoderClassifier,  # noqa: E402
                        GRUClassifier, HandwrittenAttention, PaddedTransformer, SDPAAttention, Twin,
                        batches, census, count_task, dead_share, explosion_truth, gratings,
                        lasting_onset, mha_entropy, ragged_count_task, read_trace, recorded_attention,
                        recorded_dead_share, relu_mlp, rss_growth, small_cnn, teacher_regression, waves)

from torchautopsy import Recorder  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Ground truth known by construction.
# nan_birth: the corrupted record (a -1 "missing value" in a feature that log() expects positive)
# is placed in the batch of this step, so the first non-finite forward output is at this step,
# produced by this module (its name as model.named_modules() spells it).
NAN_BIRTH_STEP = 60
NAN_BIRTH_MODULE = "features.log"
# nan_cnn_std: a blank (all-zero) frame lands in the batch of this step; per-image standardisation
# divides its zero deviation by its zero standard deviation.
NAN_CNN_STEP = 45
NAN_CNN_MODULE = "standardize"
# nan_attention_mask: an empty sequence (every key padded) lands in the batch of this step; the
# hand-written masked softmax of the first block's attention gets a row of -inf only.
NAN_ATTN_STEP = 70
NAN_ATTN_MODULE = "blocks.0.attn"
# vanishing_*: vanishing from the first step on.
VANISHING_STEP = 0
# Dead units: a layer is dead when at least this share of its units output nothing positive on
# any example of the whole training set (the share the analyzer's warning uses, too: half a layer).
DEAD_SHARE = 0.5
# Attention entropy collapse: a layer's mean normalised entropy (entropy / log(keys), averaged over
# rows and heads) below this; 0.1 is close to one-hot (a row with 0.9 on one of 16 keys has 0.16).
COLLAPSED_ENTROPY = 0.1
# exploding_*: EXPLODE_FACTOR x the median total gradient norm of the first EXPLODE_BASELINE_STEPS
# steps (sample_lib.explosion_truth). Reference runs (torch 2.13 CPU): exploding_lr 100x at step
# 45, first non-finite loss at step 48.
# ---------------------------------------------------------------------------------------------

CASES = (
    "healthy_mlp", "healthy_cnn_bn", "healthy_transformer", "healthy_gru", "healthy_plateau",
    "exploding_lr", "exploding_cnn",
    "vanishing_sigmoid", "vanishing_cnn_sigmoid",
    "nan_birth", "nan_cnn_std", "nan_attention_mask", "nan_backward_sqrt",
    "dead_relu_lr", "dead_relu_cnn_init",
    "attention_entropy_lr", "attention_sink_mask",
    "leak_losses_mlp", "leak_hook_gru",
    "oom_pairwise_mlp",
)
ARCHITECTURE = {
    "healthy_mlp": "MLP", "healthy_cnn_bn": "CNN + BatchNorm", "healthy_transformer": "transformer encoder",
    "healthy_gru": "GRU", "healthy_plateau": "MLP", "exploding_lr": "MLP", "exploding_cnn": "CNN",
    "vanishing_sigmoid": "MLP", "vanishing_cnn_sigmoid": "CNN", "nan_birth": "MLP", "nan_cnn_std": "CNN",
    "nan_attention_mask": "transformer encoder (hand-written attention)", "nan_backward_sqrt": "Siamese MLP", "dead_relu_lr": "MLP",
    "dead_relu_cnn_init": "CNN (F.relu in forward)", "attention_entropy_lr": "transformer encoder (nn.TransformerEncoder)",
    "attention_sink_mask": "transformer encoder (F.scaled_dot_product_attention)", "leak_losses_mlp": "MLP",
    "leak_hook_gru": "GRU", "oom_pairwise_mlp": "MLP",
}


def _train(model, run_dir, n_steps, batch_fn, loss_fn, opt, sched=None, clip=None, before_step=None,
           after_backward=None, backward_kwargs=None):
    """The usual loop, recorded: forward, loss, zero_grad, backward, (clip), step, rec.step(loss).
    batch_fn(step) -> inputs tuple and target; before_step(step) runs first (measurements)."""
    with Recorder(model, run_dir) as rec:
        for step in range(n_steps):
            if before_step is not None:
                before_step(step)
            inputs, target = batch_fn(step)
            loss = loss_fn(model(*inputs), target)
            opt.zero_grad()
            loss.backward(**(backward_kwargs or {}))
            if after_backward is not None:
                after_backward(step, loss)
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if sched is not None:
                sched.step()
            rec.step(loss=loss)  # no NaN check in these loops: they train on, like many real jobs


def _loss_summary(run_dir) -> dict:
    t = read_trace(run_dir)
    loss = t["loss"]
    n = max(5, len(loss) // 10)
    return {"loss_first_tenth_median": round(float(np.median(loss[:n])), 4),
            "loss_last_tenth_median": round(float(np.median(loss[-n:])), 4)}


def _expect_learned(case, run_dir, factor=0.5) -> dict:
    s = _loss_summary(run_dir)
    print(f"  loss median first tenth {s['loss_first_tenth_median']:.4g} -> last tenth "
          f"{s['loss_last_tenth_median']:.4g}")
    if not s["loss_last_tenth_median"] < factor * s["loss_first_tenth_median"]:
        raise SystemExit(f"{case}: the model did not learn ({s})")
    return s


# -- healthy runs ---------------------------------------------------------------------------------

def healthy_mlp(run_dir: str) -> dict:
    x, y = teacher_regression(seed=1)
    model = relu_mlp(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(x), seed=2)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 300, batch, F.mse_loss, opt)
    return {"kind": None, "step": None, "where": [], "evidence": {}}


def healthy_cnn_bn(run_dir: str) -> dict:
    """4 conv-BN-ReLU layers, 4-class gratings, Adam 1e-3, 200 steps."""
    x, y = gratings(4096, seed=11)
    model = small_cnn(seed=0, batchnorm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(x), seed=12)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.cross_entropy, opt)
    return {"kind": None, "step": None, "where": [], "evidence": _expect_learned("healthy_cnn_bn", run_dir)}


def healthy_transformer(run_dir: str) -> dict:
    """2-layer nn.TransformerEncoder (d 32, 4 heads), the count task with 5% label noise, Adam 1e-3
    with a 30-step linear warm-up, 300 steps."""
    tok, y = count_task(8192, seed=21, label_noise=0.05)
    torch.manual_seed(0)
    model = EncoderClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    b = batches(len(tok), seed=22)

    def batch(step):
        idx = next(b)
        return (tok[idx],), y[idx]

    _train(model, run_dir, 300, batch, F.cross_entropy, opt, sched=sched)
    return {"kind": None, "step": None, "where": [],
            "evidence": _expect_learned("healthy_transformer", run_dir)}


def healthy_gru(run_dir: str) -> dict:
    """GRU (hidden 128) over 50-step noisy sine waves, 4 frequency classes, Adam 3e-3, gradient
    clipping at 1.0, 200 steps."""
    x, y = waves(4096, seed=31)
    torch.manual_seed(0)
    model = GRUClassifier(128)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    b = batches(len(x), seed=32)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.cross_entropy, opt, clip=1.0)
    return {"kind": None, "step": None, "where": [], "evidence": _expect_learned("healthy_gru", run_dir)}


def healthy_plateau(run_dir: str) -> dict:
    """The ReLU MLP on a linear target with heavy noise (noise variance = signal variance), each
    example seen once (one epoch of 400 batches, so nothing is memorised): it fits the signal within
    ~100 steps and then sits at the noise floor (MSE ~0.5) for the remaining ~300 steps."""
    n_steps = 400
    g = torch.Generator().manual_seed(41)
    x = torch.randn(n_steps * BATCH, N_IN, generator=g)
    w = torch.randn(N_IN, 1, generator=g)
    signal = x @ w / w.norm()
    y = signal + torch.randn(len(x), 1, generator=g)
    y = (y - y.mean()) / y.std()
    model = relu_mlp(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        return (x[step * BATCH:(step + 1) * BATCH],), y[step * BATCH:(step + 1) * BATCH]

    _train(model, run_dir, n_steps, batch, F.mse_loss, opt)
    t = read_trace(run_dir)
    half = t["loss"][n_steps // 2:]
    n = len(half) // 5
    floor = float(1.0 - torch.corrcoef(torch.cat([signal, y], 1).T)[0, 1] ** 2)
    # Where the plateau begins: the first step from which the 50-step trailing median of the loss
    # stays within 10% of the median of the last 100 steps (batch-to-batch noise is ~+-8%).
    tm = np.array([np.median(t["loss"][max(0, i - 49):i + 1]) for i in range(n_steps)])
    level = float(np.median(t["loss"][-100:]))
    ev = {"noise_floor_mse": round(floor, 4),
          "plateau_from_step": lasting_onset(np.abs(tm - level) <= 0.10 * level),
          "plateau_level": round(level, 4),
          "median_loss_steps_200_239": round(float(np.median(half[:n])), 4),
          "median_loss_steps_360_399": round(float(np.median(half[-n:])), 4)}
    print(f"  plateau from step {ev['plateau_from_step']} at {level:.3f}; noise floor (MSE of the best possible predictor) {floor:.3f}; median loss over steps "
          f"200-239 {ev['median_loss_steps_200_239']:.3f}, over 360-399 {ev['median_loss_steps_360_399']:.3f}")
    return {"kind": None, "step": None, "where": [], "evidence": ev}


# -- exploding gradients ----------------------------------------------------------------------------

def _explosion_entry(case: str, run_dir: str, extra: dict) -> dict:
    t = read_trace(run_dir)
    e = explosion_truth(t)
    if e["step"] is None or e["nonfinite_step"] is None:
        raise SystemExit(f"{case} did not explode ({EXPLODE_FACTOR:g}x step {e['step']}, "
                         f"non-finite loss {e.get('nonfinite_step')})")
    step, total = e["step"], e["total"]
    print(f"  total grad norm: median of steps 0-{EXPLODE_BASELINE_STEPS - 1} = {e['base']:.3g}; "
          f"first > {EXPLODE_FACTOR:g}x at step {step} ({total[step]:.3g})")
    print(f"  first non-finite loss at step {e['nonfinite_step']}; first non-finite grad norm at step "
          f"{int(np.nonzero(~np.isfinite(total))[0][0])}; first non-finite forward output at step "
          f"{e['origin_step']}, module {e['origin']!r} (overflow)")
    print("  growth of each layer's grad norm at that step vs its own steps 0-9: "
          + ", ".join(f"{m} {v:.0f}x" for m, v in sorted(e["layer_growth"].items(), key=lambda kv: -kv[1])))
    return {"kind": "exploding_gradients", "step": step, "where": e["where"], "evidence": {
        "baseline_total_grad_norm": round(e["base"], 6),
        "total_grad_norm_at_step": round(float(total[step]), 6),
        "first_nonfinite_loss_step": e["nonfinite_step"],
        "first_nonfinite_origin": {"step": e["origin_step"], "module": e["origin"]},
        "grad_norm_growth_by_layer": {m: round(v, 1) for m, v in e["layer_growth"].items()},
        "grad_norm_growth_by_param": {n: round(float(v), 1) for n, v in e["param_growth"].items()},
        **extra,
    }}


def exploding_lr(run_dir: str) -> dict:
    x, y = teacher_regression(seed=1)
    model = relu_mlp(seed=5)
    peak_lr, warmup = 2.5, 100  # a sensible SGD lr for this model is ~0.05
    opt = torch.optim.SGD(model.parameters(), lr=peak_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    b = batches(len(x), seed=2)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 150, batch, F.mse_loss, opt, sched=sched)
    return _explosion_entry("exploding_lr", run_dir, {"peak_lr": peak_lr, "warmup_steps": warmup})


def exploding_cnn(run_dir: str) -> dict:
    """The 4-conv ReLU CNN without normalisation layers, SGD with momentum 0.9 at lr 0.3 from the
    first step (no warm-up): 3x the lr 0.1 that trains this network well (loss 1.39 -> ~0.1 in 200
    steps, measured). Loss spikes from step ~40, then overflow and NaN."""
    x, y = gratings(4096, seed=11)
    model = small_cnn(seed=0, batchnorm=False)
    lr = 0.3
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    b = batches(len(x), seed=2)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 100, batch, F.cross_entropy, opt)
    return _explosion_entry("exploding_cnn", run_dir, {"lr": lr, "momentum": 0.9, "warmup_steps": 0})


# -- vanishing gradients ----------------------------------------------------------------------------

def _vanishing_entry(run_dir: str, model: nn.Module, layer_types) -> dict:
    t = read_trace(run_dir)
    names = t["param_names"]
    w = [i for i, n in enumerate(names) if len(t["param_shapes"][i]) >= 2]
    rms = t["grad_norm"][:, w].astype(np.float64) / np.sqrt(t["numel"][w])
    first, last = names[w[0]], names[w[-1]]
    ratio_end = float(rms[-1, 0] / rms[-1, -1])
    ratio_start = float(rms[0, 0] / rms[0, -1])
    # The same ratio from the model's own gradients (the last step's, still in .grad).
    lin = [m for m in model.modules() if isinstance(m, layer_types)]
    rms_t = [(m.weight.grad.norm() / math.sqrt(m.weight.numel())).item() for m in lin]
    print(f"  grad RMS {first} / {last}: step 0 {ratio_start:.2e}, last step {ratio_end:.2e} "
          f"(from the model itself: {rms_t[0] / rms_t[-1]:.2e}); loss {t['loss'][0]:.3f} -> {t['loss'][-1]:.3f}")
    print("  per-layer weight-grad RMS at the last step: " + ", ".join(f"{v:.1e}" for v in rms[-1]))
    first_bias = names[w[0] + 1] if w[0] + 1 < len(names) and names[w[0] + 1].endswith(".bias") else None
    where = [first] + ([first_bias] if first_bias else [])
    return {"kind": "vanishing_gradients", "step": VANISHING_STEP, "where": where, "evidence": {
        "first_last_weight_grad_rms_ratio_step0": ratio_start,
        "first_last_weight_grad_rms_ratio_last_step": ratio_end,
        "first_layer": first, "last_layer": last,
    }}


def vanishing_sigmoid(run_dir: str) -> dict:
    depth, width, n_classes = 12, 32, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, N_IN, generator=g)
    y = (x @ torch.randn(N_IN, n_classes, generator=g)).argmax(dim=1)  # linearly separable classes
    torch.manual_seed(0)
    layers, d = [], N_IN
    for _ in range(depth - 1):
        layers += [nn.Linear(d, width), nn.Sigmoid()]
        d = width
    layers.append(nn.Linear(d, n_classes))
    model = nn.Sequential(OrderedDict(layers=nn.Sequential(*layers)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    b = batches(len(x), seed=4)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.cross_entropy, opt)
    return _vanishing_entry(run_dir, model, nn.Linear)


def vanishing_cnn_sigmoid(run_dir: str) -> dict:
    """8 conv layers (16 channels) with sigmoid activations and no normalisation (PyTorch's default
    init), a max-pool after the 4th, global average pooling, a linear head; SGD momentum 0.9,
    lr 0.1, 150 steps. The first conv's gradients are ~1e-8 of the head's and the loss stays at ln 4."""
    x, y = gratings(4096, seed=11)
    torch.manual_seed(0)
    layers, c = [], 1
    for i in range(1, 9):
        layers += [(f"conv{i}", nn.Conv2d(c, 16, 3, padding=1)), (f"act{i}", nn.Sigmoid())]
        c = 16
        if i == 4:
            layers.append(("pool", nn.MaxPool2d(2)))
    layers += [("gap", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()), ("fc", nn.Linear(16, 4))]
    model = nn.Sequential(OrderedDict(layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    b = batches(len(x), seed=2)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 150, batch, F.cross_entropy, opt)
    return _vanishing_entry(run_dir, model, (nn.Conv2d, nn.Linear))


# -- non-finite values ----------------------------------------------------------------------------

def _nan_entry(case: str, run_dir: str, step: int, module: str, cause: str) -> dict:
    t = read_trace(run_dir)
    origin = t["nonfinite_origin"]
    hit = np.nonzero(origin >= 0)[0]
    first = int(hit[0]) if len(hit) else None
    name = t["module_names"][origin[first]] if first is not None else None
    bad_loss = np.nonzero(~np.isfinite(t["loss"]))[0]
    print(f"  steps/nonfinite_origin first >= 0 at step {first}: module {name!r} "
          f"(expected step {step}, {module!r}); first non-finite loss at step "
          f"{int(bad_loss[0]) if len(bad_loss) else None}; batch_nonfinite at that step = "
          f"{int(t['batch_nonfinite'][first]) if first is not None else None}")
    print(f"  loss before: step 0 {t['loss'][0]:.3f}, step {step - 1} {t['loss'][step - 1]:.3f}")
    if first != step or name != module:
        raise SystemExit(f"{case}: the trace says step {first}, module {name!r}; expected "
                         f"step {step}, module {module!r}")
    if not np.all(np.isfinite(t["loss"][:step])):
        raise SystemExit(f"{case}: non-finite loss before the NaN step")
    return {"kind": "nonfinite", "step": step, "where": [module], "evidence": {"cause": cause}}


class LogFeatures(nn.Module):
    """log() of raw, positive features (counts, prices, durations): the usual log transform,
    done inside the model. A record with a non-positive value makes it produce NaN (or -Inf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def nan_birth(run_dir: str) -> dict:
    n_steps = 100
    g = torch.Generator().manual_seed(5)
    logx = torch.randn(n_steps * BATCH, N_IN, generator=g)
    raw = torch.exp(logx)  # log-normal raw features, all > 0
    torch.manual_seed(1005)
    teacher = nn.Sequential(nn.Linear(N_IN, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        y = teacher(logx)
        y = (y - y.mean()) / y.std()
    y = y + 0.1 * torch.randn(len(y), 1, generator=g)
    # One record of the batch of step NAN_BIRTH_STEP has a missing value stored as -1 by the
    # upstream export. The data is read in order (no shuffling), one batch per step.
    raw[NAN_BIRTH_STEP * BATCH + 37, 5] = -1.0

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        features=nn.Sequential(OrderedDict(log=LogFeatures(), proj=nn.Linear(N_IN, 64))),
        body=nn.Sequential(OrderedDict(act1=nn.ReLU(), fc=nn.Linear(64, 64), act2=nn.ReLU())),
        head=nn.Linear(64, 1),
    ))
    assert NAN_BIRTH_MODULE in dict(model.named_modules())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        return (raw[step * BATCH:(step + 1) * BATCH],), y[step * BATCH:(step + 1) * BATCH]

    _train(model, run_dir, n_steps, batch, F.mse_loss, opt)
    return _nan_entry("nan_birth", run_dir, NAN_BIRTH_STEP, NAN_BIRTH_MODULE,
                      "log(-1): a missing value stored as -1 in record "
                      f"{NAN_BIRTH_STEP * BATCH + 37}, feature 5")


class PerImageStandardize(nn.Module):
    """Per-image standardisation, (x - mean) / std over each image's pixels (a common first layer
    for camera data), written without the epsilon / minimum std that guards a constant image."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        return (x - mean) / x.std(dim=(1, 2, 3), keepdim=True)


def nan_cnn_std(run_dir: str) -> dict:
    """Raw grating frames (pixel values in [0, 1]), standardised per image inside the model, then the
    4-conv ReLU CNN; Adam 1e-3, 80 steps, one shuffled epoch. One frame is blank (all zeros: a
    camera dropout / failed decode); it lands in the batch of step NAN_CNN_STEP, where its
    standardisation is 0 / 0 = NaN."""
    n_steps = 80
    x, y = gratings(n_steps * BATCH, seed=13, raw=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(14))  # one epoch, shuffled
    blank = int(order[NAN_CNN_STEP * BATCH + 11])
    x[blank] = 0.0
    model = nn.Sequential(OrderedDict(standardize=PerImageStandardize(),
                                      cnn=small_cnn(seed=0, batchnorm=False)))
    assert NAN_CNN_MODULE in dict(model.named_modules())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        idx = order[step * BATCH:(step + 1) * BATCH]
        return (x[idx],), y[idx]

    _train(model, run_dir, n_steps, batch, F.cross_entropy, opt)
    return _nan_entry("nan_cnn_std", run_dir, NAN_CNN_STEP, NAN_CNN_MODULE,
                      f"0/0: frame {blank} is blank (all pixels 0), its per-image standard deviation is 0")


def _pad_batch(seqs: list[torch.Tensor]):
    tok = pad_sequence(seqs, batch_first=True, padding_value=PAD)
    return tok, tok != PAD


def nan_attention_mask(run_dir: str) -> dict:
    """A 2-block pre-LN transformer with hand-written attention (scores of padded keys set to -inf
    before the softmax) classifies variable-length token sequences (the count task), masked mean
    pooling (guarded against length 0), Adam 1e-3, batch 32, 100 steps, one shuffled epoch. One
    document is empty (every token was filtered out upstream); in the batch of step NAN_ATTN_STEP its
    attention rows are all -inf and softmax gives 0/0 = NaN."""
    n_steps, bs = 100, 32
    seqs, y = ragged_count_task(n_steps * bs, seed=51)
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(52))
    empty = int(order[NAN_ATTN_STEP * bs + 5])
    seqs[empty] = seqs[empty][:0]
    torch.manual_seed(0)
    model = PaddedTransformer(HandwrittenAttention, pooling="mean")
    assert NAN_ATTN_MODULE in dict(model.named_modules())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        idx = order[step * bs:(step + 1) * bs]
        return _pad_batch([seqs[i] for i in idx]), y[idx]

    _train(model, run_dir, n_steps, batch, F.cross_entropy, opt)
    return _nan_entry("nan_attention_mask", run_dir, NAN_ATTN_STEP, NAN_ATTN_MODULE,
                      f"softmax over a row of -inf only: document {empty} is empty, every key of it is padding")


class Siamese(nn.Module):
    """Embeds both records of a pair with one ReLU MLP and returns their Euclidean distance,
    written as sqrt(sum of squares): finite for identical records (0), but its derivative there is
    1 / (2 sqrt(0)) = Inf, and the backward pass multiplies it by 0."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(OrderedDict(
            fc1=nn.Linear(N_IN, 64), relu1=nn.ReLU(), fc2=nn.Linear(64, 64), relu2=nn.ReLU(),
            out=nn.Linear(64, 8)))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((self.embed(a) - self.embed(b)) ** 2).sum(dim=1))


NAN_BACKWARD_STEP = 55
NAN_BACKWARD_WHERE = ["embed.out.weight", "embed.out.bias"]


def nan_backward_sqrt(run_dir: str) -> dict:
    """Metric learning: a Siamese ReLU MLP trained with the contrastive loss (Hadsell et al. 2006,
    same * d^2 + (1 - same) * relu(2 - d)^2) on pairs of records from 8 clusters, read in order,
    Adam 1e-3, 100 steps. One "same" pair in the batch of step NAN_BACKWARD_STEP is a duplicated
    record (a = b): its distance is exactly 0, the forward pass and the loss stay finite, and the
    backward pass of sqrt gives 0 * Inf = NaN. The NaN enters through the last layer's parameters
    (the first the backward pass reaches), then every gradient, then every weight (Adam)."""
    n_steps = 100
    n = n_steps * BATCH
    g = torch.Generator().manual_seed(71)
    centers = 2.0 * torch.randn(8, N_IN, generator=g)
    ca = torch.randint(0, 8, (n,), generator=g)
    same = (torch.rand(n, generator=g) < 0.5)
    cb = torch.where(same, ca, (ca + torch.randint(1, 8, (n,), generator=g)) % 8)
    a = centers[ca] + 0.5 * torch.randn(n, N_IN, generator=g)
    b = centers[cb] + 0.5 * torch.randn(n, N_IN, generator=g)
    dup = NAN_BACKWARD_STEP * BATCH + 9
    same[dup] = True
    b[dup] = a[dup]  # the same record twice (a duplicate in the export)
    target = same.float()
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn(d, same):
        return (same * d ** 2 + (1 - same) * F.relu(2.0 - d) ** 2).mean()

    def batch(step):
        s = slice(step * BATCH, (step + 1) * BATCH)
        return (a[s], b[s]), target[s]

    _train(model, run_dir, n_steps, batch, loss_fn, opt)
    t = read_trace(run_dir)
    bad = t["nonfinite_origin"] >= 0
    gbad = ~np.isfinite(t["grad_norm"]).all(axis=1)
    first_g = int(np.flatnonzero(gbad)[0]) if gbad.any() else None
    first_f = int(np.flatnonzero(bad)[0]) if bad.any() else None
    print(f"  first non-finite gradient at step {first_g} (expected {NAN_BACKWARD_STEP}); loss there "
          f"{t['loss'][NAN_BACKWARD_STEP]:.4g} (finite); first non-finite forward output at step {first_f} "
          f"(the weights went NaN in that step's update)")
    if first_g != NAN_BACKWARD_STEP or not np.isfinite(t["loss"][:NAN_BACKWARD_STEP + 1]).all() or \
            (first_f is not None and first_f <= NAN_BACKWARD_STEP):
        raise SystemExit("nan_backward_sqrt: the NaN did not appear first in the backward pass of step "
                         f"{NAN_BACKWARD_STEP}")
    return {"kind": "nonfinite", "step": NAN_BACKWARD_STEP, "where": NAN_BACKWARD_WHERE, "evidence": {
        "stage": "backward",
        "cause": f"sqrt'(0) = Inf times 0: pair {dup} is one record twice, distance exactly 0",
        "loss_at_step": float(t["loss"][NAN_BACKWARD_STEP]),
        "first_nonfinite_forward_step": first_f,
    }}


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


# -- memory leaks -----------------------------------------------------------------------------------

def _leak_entry(case: str, run_dir: str, where: list[str], extra: dict) -> dict:
    t = read_trace(run_dir)
    g = rss_growth(t)
    c = census(t)
    print(f"  resident memory {g['rss_mib_first']:.0f} -> {g['rss_mib_last']:.0f} MiB, "
          f"{g['mib_per_step']:.2f} MiB/step (straight-line fit R^2 {g['r2']:.3f}); "
          f"tensor census [step, tensors, with graph, MiB]: {c}")
    if not (g["mib_per_step"] > 1.0 and g["r2"] > 0.95):
        raise SystemExit(f"{case}: memory does not grow steadily ({g})")
    return {"kind": "memory_leak", "step": 0, "where": where, "evidence": {**g, "census": c, **extra}}


def leak_losses_mlp(run_dir: str) -> dict:
    """A ReLU MLP (width 256, batch 512) whose loop keeps every loss tensor for a plot at the end
    (losses.append(loss)) and calls loss.backward(retain_graph=True), a leftover from debugging. Each
    kept loss holds its step's graph and, because of retain_graph, the activations the graph saved
    (~2 MiB per step). Without retain_graph backward frees those and the leak is only the graph's
    nodes (a few KB per step, measured). Adam 1e-3, 200 steps."""
    x, y = teacher_regression(seed=1, n=8192)
    model = relu_mlp(seed=0, width=256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(x), seed=2, batch=512)
    losses = []

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.mse_loss, opt, backward_kwargs={"retain_graph": True},
           after_backward=lambda step, loss: losses.append(loss))
    return _leak_entry("leak_losses_mlp", run_dir, [], {
        "cause": "losses.append(loss) with loss.backward(retain_graph=True)",
        "kept_losses_with_graph": sum(1 for v in losses if v.grad_fn is not None)})


def leak_hook_gru(run_dir: str) -> dict:
    """healthy_gru's model, data and recipe, plus a forward hook on the GRU that collects its output
    sequences for a later look at the hidden states (hidden_states.append(output.detach())) and is
    never removed or cleared: 64 x 50 x 128 float32 = 1.6 MiB kept per step. 200 steps."""
    x, y = waves(4096, seed=31)
    torch.manual_seed(0)
    model = GRUClassifier(128)
    hidden_states = []
    model.gru.register_forward_hook(lambda mod, args, out: hidden_states.append(out[0].detach()))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    b = batches(len(x), seed=32)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.cross_entropy, opt, clip=1.0)
    kept = sum(h.numel() * h.element_size() for h in hidden_states) / 2 ** 20
    return _leak_entry("leak_hook_gru", run_dir, ["gru"], {
        "cause": "a forward hook on gru appends output.detach() to a list every step",
        "kept_tensors": len(hidden_states), "kept_mib": round(kept, 1),
        "kept_mib_per_step": round(kept / len(hidden_states), 3)})


# -- running out of memory ----------------------------------------------------------------------------

# Items in the retrieval bank of oom_pairwise_mlp: their all-pairs difference tensor is
# 2**20 x 2**20 x 64 float32 = 256 TiB, which no machine's allocator grants (it is refused at once,
# before any page is touched, so making the sample is safe on a shared machine).
OOM_BANK_ITEMS = 2**20
OOM_STEP = 60


def _pairwise_retrieval(model: nn.Module, bank_inputs: torch.Tensor) -> float:
    """Mean distance to the nearest other item of the bank, in the first layer's feature space,
    written with broadcasting (the bug: fine on the 512-item bank it was tried on)."""
    feats = model.fc1(bank_inputs).detach()
    d = (feats[:, None, :] - feats[None, :, :]).norm(dim=-1)  # items x items x features first
    return float(d.topk(2, largest=False).values[:, 1].mean())


def oom_pairwise_mlp(run_dir: str) -> dict:
    """healthy_mlp's model, data and recipe (Adam 1e-3), plus a retrieval metric every 60 steps
    over a bank of 2**20 inputs. At step 60 the metric asks for a 256 TiB all-pairs tensor: the CPU
    allocator raises, the error leaves the `with Recorder(...)` block and the job ends. The
    recorder keeps the error, where it was raised and a census of live tensors (the largest: the
    bank's 2**20 x 16 inputs and their 2**20 x 64 features)."""
    x, y = teacher_regression(seed=1)
    model = relu_mlp(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(x), seed=2)
    bank = torch.randn(OOM_BANK_ITEMS, x.shape[1], generator=torch.Generator().manual_seed(3))

    def batch(step):
        if step and step % OOM_STEP == 0:
            _pairwise_retrieval(model, bank)
        idx = next(b)
        return (x[idx],), y[idx]

    try:
        _train(model, run_dir, 200, batch, F.mse_loss, opt)
    except RuntimeError as e:
        if "can't allocate memory" not in str(e):
            raise
        message = str(e).split("DefaultCPUAllocator: ", 1)[-1][:120]
    else:
        raise SystemExit("oom_pairwise_mlp: the pairwise tensor was allocated (no out-of-memory error)")
    t = read_trace(run_dir)
    if len(t["step"]) != OOM_STEP:
        raise SystemExit(f"oom_pairwise_mlp: {len(t['step'])} steps recorded, expected {OOM_STEP}")
    print(f"  out of memory at step {OOM_STEP}: {message}")
    return {"kind": "out_of_memory", "step": OOM_STEP, "where": [], "evidence": {
        "cause": "all-pairs differences over a 2**20-item bank by broadcasting: 2**20 x 2**20 x 64 float32",
        "requested_bytes": OOM_BANK_ITEMS * OOM_BANK_ITEMS * 64 * 4, "error": message}}


def step_tolerance(kind, step) -> int:
    """How far the analyzer's step may be from the true one, given how the data is sampled:
    per-unit activity is recorded in windows (5, 10, 20, 40 steps, then 50: a death is known to
    the window), attention on watched steps (every 10th in the first 100 steps, then up to 50
    apart: these small models' watched steps cost more than the recorder's 0.5% budget), and a
    leak's onset is estimated from a noisy line."""
    if kind == "dead_relu":
        start, length = 0, 5
        while start + length <= step:
            start, length = start + length, min(50, length * 2)
        return length
    if kind == "attention_collapse":
        return 10 if step < 100 else 50
    return {"memory_leak": 10}.get(kind, 0)


# -- driver -------------------------------------------------------------------------------------

def _check_common(case: str, run_dir: str) -> None:
    t = read_trace(run_dir)
    n = len(t["step"])
    if not np.array_equal(t["step"], np.arange(n)):
        raise SystemExit(f"{case}: steps/step is not 0..{n - 1}")
    if len(t["grad_norm"]) != n:
        raise SystemExit(f"{case}: params has {len(t['grad_norm'])} rows, steps has {n}")
    dropped = int(t["attrs"].get("dropped_steps", 0)) + int(t["attrs"].get("dropped_rows", 0))
    if dropped:
        raise SystemExit(f"{case}: the recorder dropped {dropped} steps")
    size = os.path.getsize(os.path.join(run_dir, "rank0.h5"))
    if size > 3_000_000:  # two snapshots of the model (steps 0 and the end) included
        raise SystemExit(f"{case}: the trace is {size / 1e6:.2f} MB, over 3 MB")
    finite = np.isfinite(t["loss"])
    print(f"  {n} steps, {size / 1e6:.2f} MB, loss {t['loss'][0]:.4g} -> "
          f"{t['loss'][finite][-1] if finite.any() else float('nan'):.4g} (last finite), "
          f"non-finite losses: {int((~finite).sum())}")
    if case.startswith("healthy"):
        total = np.sqrt(np.sum(t["grad_norm"].astype(np.float64) ** 2, axis=1))
        base = np.median(total[:EXPLODE_BASELINE_STEPS])
        print(f"  total grad norm / median of steps 0-9: min {total.min() / base:.2f}, max {total.max() / base:.2f}")
        if not finite.all() or (t["nonfinite_origin"] >= 0).any() or total.max() > 0.5 * EXPLODE_FACTOR * base:
            raise SystemExit(f"{case} is not healthy")


RUNNERS = {name: globals()[name] for name in CASES}


def _run_case(job):
    """Run one case (in a worker process); returns (case, entry or None, log, seconds)."""
    case, out = job
    torch.set_num_threads(1)
    run_dir = os.path.join(out, case)
    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    buf = io.StringIO()
    t0 = time.perf_counter()
    entry = None
    with contextlib.redirect_stdout(buf):
        try:
            entry = RUNNERS[case](run_dir)
            entry = {"kind": entry["kind"], "step": entry["step"], "where": entry["where"],
                     "step_tolerance": step_tolerance(entry["kind"], entry["step"]),
                     "evidence": {"architecture": ARCHITECTURE[case], **entry["evidence"]}}
            _check_common(case, run_dir)
            print(f"  -> {os.path.join(run_dir, 'rank0.h5')}")
        except SystemExit as e:
            print(f"  FAILED: {e}")
            entry = None
        except Exception:
            print("  FAILED:\n" + traceback.format_exc())
            entry = None
    return case, entry, buf.getvalue(), time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                   help="folder for the run directories and expected.json (default: this script's folder)")
    p.add_argument("--jobs", type=int, default=2, help="cases run side by side (default 2)")
    p.add_argument("cases", nargs="*", metavar="CASE", help=f"cases to make (default: all): {', '.join(CASES)}")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    cases = args.cases or list(CASES)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    exp_path = os.path.join(out, "expected.json")
    expected = {}
    if os.path.exists(exp_path):
        with open(exp_path) as f:
            expected = json.load(f)
    torch.set_num_threads(1)
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    t_all = time.perf_counter()
    failed = []
    with ctx.Pool(processes=max(1, args.jobs), maxtasksperchild=1) as pool:
        for case, entry, log, secs in pool.imap(_run_case, [(c, out) for c in cases]):
            print(f"{case}:\n{log.rstrip()}\n  ({secs:.1f} s)", flush=True)
            if entry is None:
                failed.append(case)
            else:
                expected[case] = entry
    expected = {c: expected[c] for c in CASES if c in expected} | {c: v for c, v in expected.items() if c not in CASES}
    with open(exp_path, "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    print(f"wrote {exp_path}; total {time.perf_counter() - t_all:.1f} s")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
