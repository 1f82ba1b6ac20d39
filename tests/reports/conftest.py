"""Real traces for the report tests: tiny torch models trained for 30 steps with the Recorder."""

from __future__ import annotations

import h5py
import pytest
import torch
from torch import nn

from reports_testlib import HOSTILE_IMG, HOSTILE_SCRIPT
from torchautopsy import Recorder, load

N_STEPS = 30


def mlp(width: int = 32, depth: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def record(model: nn.Module, run_dir, lr: float, steps: int = N_STEPS) -> None:
    """Train ``model`` by SGD on a fixed regression batch (target: sum of squares), recorded."""
    torch.manual_seed(0)
    x = torch.randn(64, 8) * 3
    y = (x ** 2).sum(1, keepdim=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with Recorder(model, run_dir) as rec:
        for _ in range(steps):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)


@pytest.fixture(scope="session")
def healthy_dir(tmp_path_factory):
    torch.manual_seed(0)
    run_dir = tmp_path_factory.mktemp("healthy")
    record(mlp(), run_dir, lr=1e-4)
    return run_dir


@pytest.fixture(scope="session")
def diverged_dir(tmp_path_factory):
    """A learning rate far too high: the gradients overflow and the loss goes NaN in a few steps."""
    torch.manual_seed(0)
    run_dir = tmp_path_factory.mktemp("diverged")
    record(mlp(), run_dir, lr=0.02)
    return run_dir


@pytest.fixture(scope="session")
def hostile_dir(tmp_path_factory):
    """A model whose class and module names are HTML, as a trace attached to a ticket may hold."""
    torch.manual_seed(0)
    hostile_class = type(f"Net{HOSTILE_SCRIPT}", (nn.Sequential,), {})
    model = hostile_class(nn.Linear(8, 16), nn.ReLU())
    model.add_module(HOSTILE_SCRIPT, nn.ReLU())
    model.add_module(HOSTILE_IMG, nn.Linear(16, 1))
    run_dir = tmp_path_factory.mktemp("hostile")
    record(model, run_dir, lr=1e-4)
    return run_dir


@pytest.fixture(scope="session")
def wide_dir(tmp_path_factory):
    """More weight matrices (16) than the gradient plot draws lines (12)."""
    torch.manual_seed(0)
    run_dir = tmp_path_factory.mktemp("wide")
    record(mlp(width=8, depth=15), run_dir, lr=1e-4, steps=10)
    return run_dir


@pytest.fixture()
def healthy(healthy_dir):
    return load(healthy_dir)


@pytest.fixture()
def diverged(diverged_dir):
    return load(diverged_dir)


@pytest.fixture()
def hostile(hostile_dir):
    return load(hostile_dir)


@pytest.fixture()
def wide(wide_dir):
    return load(wide_dir)


@pytest.fixture()
def killed(healthy_dir, tmp_path):
    """The healthy trace as a SIGKILLed job leaves it: the writer never marked it closed."""
    path = tmp_path / "rank0.h5"
    path.write_bytes((healthy_dir / "rank0.h5").read_bytes())
    with h5py.File(path, "r+") as f:
        f.attrs["closed"] = False
        for key in ("end_reason", "end_unix", "n_steps_recorded"):
            if key in f.attrs:
                del f.attrs[key]
    return load(tmp_path)


@pytest.fixture()
def two_ranks(healthy_dir, tmp_path):
    """The healthy trace twice, as rank 0 and rank 1 of a world of 2."""
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.h5"
        path.write_bytes((healthy_dir / "rank0.h5").read_bytes())
        with h5py.File(path, "r+") as f:
            f.attrs["rank"] = rank
            f.attrs["world_size"] = 2
    return load(tmp_path)
