"""The gradient-scale cases of make_samples.py: exploding_lr and exploding_cnn (a learning rate too
high; step and where measured from the trace, sample_truth.explosion_truth) and vanishing_sigmoid
and vanishing_cnn_sigmoid (sigmoid derivatives compounding over depth; step 0, the first layer,
by construction), with the entry builders that read each trace back and check it.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cases_common import _train
from sample_lib import N_IN, batches, gratings, relu_mlp, small_cnn, teacher_regression
from sample_truth import EXPLODE_BASELINE_STEPS, EXPLODE_FACTOR, explosion_truth, read_trace

# ---------------------------------------------------------------------------------------------
# vanishing_*: vanishing from the first step on.
VANISHING_STEP = 0
# exploding_*: EXPLODE_FACTOR x the median total gradient norm of the first EXPLODE_BASELINE_STEPS
# steps (sample_truth.explosion_truth). Reference runs (torch 2.13 CPU): exploding_lr 100x at step
# 45, first non-finite loss at step 48.
# ---------------------------------------------------------------------------------------------


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
