"""Make the sample traces: small, real training runs, healthy and broken, recorded by torchautopsy.

    python sample_traces/make_samples.py [--out DIR] [CASE ...]

Every case trains a small model on synthetic data generated here (no downloads) with the recorder
on, and writes ``DIR/<case>/rank0.h5`` (DIR defaults to the folder of this script). With no CASE,
all cases run. The ground truth of every case goes to ``DIR/expected.json``
(case -> {"kind", "step", "where", "evidence"}); running a subset of cases updates only their entries.

Nothing is faked: each failure arises the way it does in real training, from the data, the
architecture or the hyper-parameters, and the numbers in the trace are what the recorder saw.

Everything is seeded (torch.manual_seed for the initial weights, torch.Generator for data and
batch order), so the same torch version on the same machine writes the same losses, bit for bit
(checked with 1 and 2 CPU threads). The losses are also bit-identical to the same loops without
the recorder.
The script checks each trace after writing it (h5py only) and prints what it found.

Cases:

healthy_mlp
    4-layer ReLU MLP (width 64), regression on a noisy teacher network, Adam lr 1e-3, 300 steps.
    Nothing goes wrong. kind: null.
exploding_lr
    The same kind of MLP and data, plain SGD (no momentum) with a linear warm-up over 100 steps to
    a peak learning rate of 2.5, about 50x a sensible one. As the learning rate passes the
    stability limit (~0.7 here) the loss spikes and recovers (steps ~25-30), then from step ~38
    (lr ~1.0) the loss and the gradient norms of every layer grow by orders of magnitude within
    ten steps, overflow to Inf and turn NaN; training goes on with NaN to step 150.
    kind: exploding_gradients; step: the first step whose total gradient norm exceeds 100x the
    median of steps 0-9 (measured from the trace); where: the parameters of the layer whose
    gradient norm grew most at that step, relative to its own steps 0-9.
vanishing_sigmoid
    12 Linear layers with Sigmoid activations (width 32, PyTorch's default init), 4-class
    classification, SGD lr 0.1, 200 steps. The first layer's weight gradients are ~1e-10 of the last
    layer's from step 0 on and the loss stays near ln(4). kind: vanishing_gradients; step: 0;
    where: the first layer's weight and bias.
nan_birth
    A model that takes log() of raw positive features in a custom module, ``features.log``.
    The data set is read in order; one record has a missing value stored as -1 and lands in the
    batch of step NAN_BIRTH_STEP, where log(-1) = NaN. Training before that step is healthy (Adam).
    kind: nonfinite; step: NAN_BIRTH_STEP; where: NAN_BIRTH_MODULE.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections import OrderedDict

import h5py
import numpy as np
import torch
from torch import nn

from torchautopsy import Recorder

# ---------------------------------------------------------------------------------------------
# Ground truth known by construction.
# nan_birth: the corrupted record (a -1 "missing value" in a feature that log() expects positive)
# is placed in the batch of this step, so the first non-finite forward output is at this step,
# produced by this module (its name as model.named_modules() spells it).
NAN_BIRTH_STEP = 60
NAN_BIRTH_MODULE = "features.log"
# vanishing_sigmoid: vanishing from the first step on.
VANISHING_STEP = 0
# Ground truth measured from the trace when it is written (printed, and stored in expected.json):
# exploding_lr: the first step whose total gradient norm exceeds EXPLODE_FACTOR x the median
# total gradient norm over the first EXPLODE_BASELINE_STEPS steps. Reference run (torch 2.13 CPU):
# 100x at step 45, first non-finite loss at step 48.
EXPLODE_FACTOR = 100.0
EXPLODE_BASELINE_STEPS = 10
# ---------------------------------------------------------------------------------------------

CASES = ("healthy_mlp", "exploding_lr", "vanishing_sigmoid", "nan_birth")
N_IN = 16
BATCH = 64


def _teacher_regression(seed: int, n: int = 4096):
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


def _relu_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(
        fc1=nn.Linear(N_IN, 64), relu1=nn.ReLU(),
        fc2=nn.Linear(64, 64), relu2=nn.ReLU(),
        fc3=nn.Linear(64, 64), relu3=nn.ReLU(),
        out=nn.Linear(64, 1),
    ))


def _batches(n: int, seed: int):
    """Mini-batches of indices drawn uniformly (with replacement), from their own generator."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, n, (BATCH,), generator=g)


# -- the cases ----------------------------------------------------------------------------------

def healthy_mlp(run_dir: str) -> dict:
    x, y = _teacher_regression(seed=1)
    model = _relu_mlp(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = _batches(len(x), seed=2)
    with Recorder(model, run_dir) as rec:
        for step in range(300):
            idx = next(batches)
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    return {"kind": None, "step": None, "where": [], "evidence": {}}


def exploding_lr(run_dir: str) -> dict:
    x, y = _teacher_regression(seed=1)
    model = _relu_mlp(seed=5)
    peak_lr, warmup = 2.5, 100  # a sensible SGD lr for this model is ~0.05
    opt = torch.optim.SGD(model.parameters(), lr=peak_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    batches = _batches(len(x), seed=2)
    with Recorder(model, run_dir) as rec:
        for step in range(150):
            idx = next(batches)
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            rec.step(loss=loss)  # no NaN check in this loop: it trains on, like many real jobs

    t = _read(run_dir)
    total = np.sqrt(np.sum(t["grad_norm"].astype(np.float64) ** 2, axis=1))
    base = float(np.median(total[:EXPLODE_BASELINE_STEPS]))
    over = np.nonzero(total > EXPLODE_FACTOR * base)[0]  # NaN compares False, Inf True
    step = int(over[0]) if len(over) else None
    bad_loss = np.nonzero(~np.isfinite(t["loss"]))[0]
    nonfinite_step = int(bad_loss[0]) if len(bad_loss) else None
    if step is None or nonfinite_step is None:
        raise SystemExit(f"exploding_lr did not explode (100x step {step}, non-finite loss {nonfinite_step})")
    # Most affected layer: the largest growth of its gradient norm (its parameters together) at
    # that step, relative to its own median over the baseline steps.
    names = t["param_names"]
    g = t["grad_norm"].astype(np.float64)
    layers = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names))  # fc1, fc2, ... in model order
    cols = {m: [i for i, n in enumerate(names) if n.rsplit(".", 1)[0] == m] for m in layers}
    layer_norm = {m: np.sqrt((g[:, c] ** 2).sum(axis=1)) for m, c in cols.items()}
    lgrowth = {m: float(v[step] / np.median(v[:EXPLODE_BASELINE_STEPS])) for m, v in layer_norm.items()}
    top = max(layers, key=lambda m: lgrowth[m])
    where = [names[i] for i in cols[top]]
    growth = g[step] / np.median(g[:EXPLODE_BASELINE_STEPS], axis=0)
    print(f"  total grad norm: median of steps 0-{EXPLODE_BASELINE_STEPS - 1} = {base:.3g}; "
          f"first > {EXPLODE_FACTOR:g}x at step {step} ({total[step]:.3g})")
    hit = np.nonzero(t["nonfinite_origin"] >= 0)[0]
    origin_step = int(hit[0]) if len(hit) else None
    origin = t["module_names"][t["nonfinite_origin"][origin_step]] if len(hit) else None
    print(f"  first non-finite loss at step {nonfinite_step}; first non-finite grad norm at step "
          f"{int(np.nonzero(~np.isfinite(total))[0][0])}; first non-finite forward output at step "
          f"{origin_step}, module {origin!r} (overflow)")
    print("  growth of each layer's grad norm at that step vs its own steps 0-9: "
          + ", ".join(f"{m} {v:.0f}x" for m, v in sorted(lgrowth.items(), key=lambda kv: -kv[1])))
    return {"kind": "exploding_gradients", "step": step, "where": where, "evidence": {
        "baseline_total_grad_norm": round(base, 6),
        "total_grad_norm_at_step": round(float(total[step]), 6),
        "first_nonfinite_loss_step": nonfinite_step,
        "first_nonfinite_origin": {"step": origin_step, "module": origin},
        "grad_norm_growth_by_layer": {m: round(v, 1) for m, v in lgrowth.items()},
        "grad_norm_growth_by_param": {n: round(float(v), 1) for n, v in zip(names, growth)},
        "peak_lr": peak_lr, "warmup_steps": warmup,
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
    batches = _batches(len(x), seed=4)
    with Recorder(model, run_dir) as rec:
        for step in range(200):
            idx = next(batches)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)

    t = _read(run_dir)
    names = t["param_names"]
    w = [i for i, n in enumerate(names) if n.endswith(".weight")]
    rms = t["grad_norm"][:, w].astype(np.float64) / np.sqrt(t["numel"][w])
    first, last = names[w[0]], names[w[-1]]
    ratio_end = float(rms[-1, 0] / rms[-1, -1])
    ratio_start = float(rms[0, 0] / rms[0, -1])
    # The same ratio from the model's own gradients (the last step's, still in .grad).
    lin = [m for m in model.modules() if isinstance(m, nn.Linear)]
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
    with Recorder(model, run_dir) as rec:
        for step in range(n_steps):
            xb = raw[step * BATCH:(step + 1) * BATCH]
            yb = y[step * BATCH:(step + 1) * BATCH]
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)

    t = _read(run_dir)
    origin = t["nonfinite_origin"]
    hit = np.nonzero(origin >= 0)[0]
    first = int(hit[0]) if len(hit) else None
    name = t["module_names"][origin[first]] if first is not None else None
    bad_loss = np.nonzero(~np.isfinite(t["loss"]))[0]
    print(f"  steps/nonfinite_origin first >= 0 at step {first}: module {name!r} "
          f"(expected step {NAN_BIRTH_STEP}, {NAN_BIRTH_MODULE!r}); first non-finite loss at step "
          f"{int(bad_loss[0]) if len(bad_loss) else None}; batch_nonfinite at that step = "
          f"{int(t['batch_nonfinite'][first]) if first is not None else None}")
    print(f"  loss before: step 0 {t['loss'][0]:.3f}, step {NAN_BIRTH_STEP - 1} {t['loss'][NAN_BIRTH_STEP - 1]:.3f}")
    if first != NAN_BIRTH_STEP or name != NAN_BIRTH_MODULE:
        raise SystemExit(f"nan_birth: the trace says step {first}, module {name!r}; expected "
                         f"step {NAN_BIRTH_STEP}, module {NAN_BIRTH_MODULE!r}")
    if not np.all(np.isfinite(t["loss"][:NAN_BIRTH_STEP])):
        raise SystemExit("nan_birth: non-finite loss before the NaN step")
    return {"kind": "nonfinite", "step": NAN_BIRTH_STEP, "where": [NAN_BIRTH_MODULE], "evidence": {
        "cause": "log(-1): a missing value stored as -1 in record "
                 f"{NAN_BIRTH_STEP * BATCH + 37}, feature 5",
    }}


# -- reading a trace back (h5py only, as any reader of the format would) --------------------------

def _read(run_dir: str) -> dict:
    with h5py.File(os.path.join(run_dir, "rank0.h5"), "r") as f:
        return {
            "step": f["steps/step"][:],
            "loss": f["steps/loss"][:],
            "nonfinite_origin": f["steps/nonfinite_origin"][:],
            "batch_nonfinite": f["steps/batch_nonfinite"][:],
            "grad_norm": f["params/grad_norm"][:],
            "param_names": [s.decode() if isinstance(s, bytes) else s for s in f["params/name"][:]],
            "numel": f["params/numel"][:],
            "module_names": [s.decode() if isinstance(s, bytes) else s for s in f["modules/name"][:]],
            "attrs": dict(f.attrs),
        }


def _check_common(case: str, run_dir: str) -> None:
    t = _read(run_dir)
    n = len(t["step"])
    if not np.array_equal(t["step"], np.arange(n)):
        raise SystemExit(f"{case}: steps/step is not 0..{n - 1}")
    if len(t["grad_norm"]) != n:
        raise SystemExit(f"{case}: params has {len(t['grad_norm'])} rows, steps has {n}")
    if t["attrs"].get("dropped_rows", 0):
        raise SystemExit(f"{case}: the recorder dropped {t['attrs']['dropped_rows']} rows")
    size = os.path.getsize(os.path.join(run_dir, "rank0.h5"))
    finite = np.isfinite(t["loss"])
    print(f"  {n} steps, {size / 1e6:.2f} MB, loss {t['loss'][0]:.4g} -> "
          f"{t['loss'][finite][-1] if finite.any() else float('nan'):.4g} (last finite), "
          f"non-finite losses: {int((~finite).sum())}")
    if case == "healthy_mlp":
        total = np.sqrt(np.sum(t["grad_norm"].astype(np.float64) ** 2, axis=1))
        base = np.median(total[:EXPLODE_BASELINE_STEPS])
        print(f"  total grad norm / early median: min {total.min() / base:.2f}, max {total.max() / base:.2f}")
        if not finite.all() or (t["nonfinite_origin"] >= 0).any() or total.max() > 10 * base:
            raise SystemExit("healthy_mlp is not healthy")


RUNNERS = {"healthy_mlp": healthy_mlp, "exploding_lr": exploding_lr,
           "vanishing_sigmoid": vanishing_sigmoid, "nan_birth": nan_birth}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                   help="folder for the run directories and expected.json (default: this script's folder)")
    p.add_argument("cases", nargs="*", metavar="CASE", help=f"cases to make (default: all): {', '.join(CASES)}")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    cases = args.cases or list(CASES)

    os.makedirs(args.out, exist_ok=True)
    exp_path = os.path.join(args.out, "expected.json")
    expected = {}
    if os.path.exists(exp_path):
        with open(exp_path) as f:
            expected = json.load(f)
    t_all = time.perf_counter()
    for case in cases:
        run_dir = os.path.join(args.out, case)
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir)
        print(f"{case}:")
        t0 = time.perf_counter()
        expected[case] = RUNNERS[case](run_dir)
        _check_common(case, run_dir)
        print(f"  -> {os.path.join(run_dir, 'rank0.h5')} ({time.perf_counter() - t0:.1f} s)")
    expected = {c: expected[c] for c in CASES if c in expected} | {c: v for c, v in expected.items() if c not in CASES}
    with open(exp_path, "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    print(f"wrote {exp_path}; total {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
