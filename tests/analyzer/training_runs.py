"""Tiny real training runs recorded by the Recorder, for the loss and update-ratio detector tests.

Every run is seeded (weights, data), CPU, a few hundred milliseconds: nothing is faked, each
failure arises from the optimizer, the data or the model as it does in real training.
"""

from __future__ import annotations

import torch
from torch import nn

from tests import training
from torchautopsy import load


def mlp(d_in: int = 8, width: int = 32, depth: int = 2, d_out: int = 1) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, d_out))


def teacher_data(seed: int = 1, n: int = 64, noise: float = 0.1, target_scale=None):
    """Regression on a fixed random teacher MLP plus noise; ``target_scale(step)`` corrupts targets."""
    torch.manual_seed(123)
    teacher = mlp()
    for p in teacher.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)

    def batch(step: int):
        x = torch.randn(n, 8, generator=g)
        y = teacher(x) + noise * torch.randn(n, 1, generator=g)
        if target_scale is not None:
            y = y * target_scale(step)
        return x, y, nn.functional.mse_loss

    return batch


def noise_data(seed: int = 1, n: int = 64):
    """Targets independent of the inputs: nothing beyond their mean can be learned."""
    g = torch.Generator().manual_seed(seed)

    def batch(step: int):
        return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g), nn.functional.mse_loss

    return batch


def class_data(seed: int = 2, n: int = 64):
    """4-class classification of a simple rule on the inputs."""
    g = torch.Generator().manual_seed(seed)

    def batch(step: int):
        x = torch.randn(n, 8, generator=g)
        y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
        return x, y, nn.functional.cross_entropy

    return batch


def train(run_dir, model: nn.Module, opt: torch.optim.Optimizer, steps: int, data, lr_at=None,
          pass_loss=True):
    """Train ``model`` with the Recorder on; ``lr_at(step)`` sets the learning rate of each step;
    ``pass_loss`` (a bool, or a function of the step) says whether rec.step() gets the loss."""
    training.train(model, run_dir, steps, data, lambda out, y, loss_fn: loss_fn(out, y), optimizer=opt,
                   lr_at=lr_at, pass_loss=pass_loss)
    return load(run_dir)
