"""MLP scenarios (the examples the other families follow)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, record_loop, scenario, seed_all


def _teacher(g: torch.Generator, n_in: int = 16):
    w = torch.randn(n_in, 1, generator=g) / math.sqrt(n_in)

    def batch(step: int):
        x = torch.randn(64, n_in, generator=g)
        return x, torch.tanh(x @ w) + 0.05 * torch.randn(64, 1, generator=g)

    return batch


@scenario("mlp_healthy_adamw_cosine", "mlp", None, "healthy",
          "the usual recipe: AdamW, linear warm-up then cosine decay (Loshchilov & Hutter 2019)")
def mlp_healthy_adamw_cosine(run_dir: str) -> Oracle:
    g = seed_all(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    steps, warm = 300, 30
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    losses = record_loop(model, run_dir, _teacher(g), steps, opt, F.mse_loss, scheduler=sched)
    # The oracle of health: the loss falls and stays finite.
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.5 * sum(losses[:20]), losses[::30]
    return Oracle(None, evidence={"loss_first": losses[0], "loss_last": losses[-1]})


@scenario("mlp_log_of_relu_weightless", "mlp", "nonfinite", "init",
          "log of a ReLU's zeros = -inf in a weightless module, fed to a Linear (issue 22's report: "
          "the finding blamed the Linear)")
def mlp_log_of_relu_weightless(run_dir: str) -> Oracle:
    class LogFeatures(nn.Module):  # a weightless feature transform: log of a non-negative input
        def forward(self, x):
            return torch.log(x)

    g = seed_all(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), LogFeatures(), nn.Linear(32, 1))
    teacher = _teacher(g)
    seen = {}

    def batch(step):
        x, y = teacher(step)
        return x, y

    # The oracle: the first step whose log's output is -inf while its input is finite (hooks of ours).
    def hook(module, args, out):
        if torch.is_grad_enabled() and "step" not in seen and not torch.isfinite(out).all() and torch.isfinite(args[0]).all():
            seen["step"] = seen_step[0]

    seen_step = [0]
    model[2].register_forward_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    record_loop(model, run_dir, batch, 60, opt, F.mse_loss, after_step=lambda s, l: seen_step.__setitem__(0, s + 1))
    assert seen.get("step") is not None
    return Oracle("nonfinite", step=seen["step"], where=["2"], step_tolerance=0,
                  evidence={"first_inf_step": seen["step"]})
