"""The healthy cases of make_samples.py (kind null: the analyzer must raise no warning or error):
healthy_mlp, healthy_cnn_bn, healthy_transformer, healthy_gru and healthy_plateau, whose loss
flattens at its noise floor. Their recipes are the baselines the broken cases of the other
cases_*.py modules change one thing in.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cases_common import _expect_learned, _train
from sample_lib import (BATCH, N_IN, EncoderClassifier, GRUClassifier, batches, count_task, gratings, relu_mlp,
                        small_cnn, teacher_regression, waves)
from sample_truth import lasting_onset, read_trace


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
