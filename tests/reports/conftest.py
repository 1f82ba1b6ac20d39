"""Real traces for the report tests: tiny torch models trained with the Recorder, the shipped
sample traces, and the tools that look at reports as a user would (Chromium, pdftoppm)."""

from __future__ import annotations

import shutil

import h5py
import pytest
import torch
from torch import nn

from browser import Browser, find_chromium
from reports_testlib import HOSTILE_IMG, HOSTILE_LONG, HOSTILE_SCRIPT, HOSTILE_UNICODE
from tests.training import squared, squared_error, train
from torchautopsy import load

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
    train(model, run_dir, steps, (x, y), squared_error, optimizer=torch.optim.SGD(model.parameters(), lr=lr))


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
    model.add_module(HOSTILE_LONG, nn.Linear(16, 16))
    model.add_module(HOSTILE_UNICODE, nn.ReLU())
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


@pytest.fixture(scope="session")
def wide_many_dir(tmp_path_factory):
    """600 Linear + 600 ReLU layers: more layers than any table or heatmap of a report shows."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(600):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    model = nn.Sequential(*layers)
    x = torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train(model, tmp_path_factory.mktemp("wide_many"), 6, x, squared, optimizer=opt)


@pytest.fixture(scope="session")
def long_dir(tmp_path_factory):
    """3,000 steps: more than a figure draws points (2,000) or a heatmap columns (400)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    return train(model, tmp_path_factory.mktemp("long"), 3000, (x, y), squared_error, optimizer=opt)


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the whole session (Debian's chromium package)."""
    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium); .ci/run installs it")
    with Browser(exe) as b:
        yield b


@pytest.fixture(scope="session")
def pdftoppm():
    exe = shutil.which("pdftoppm")
    if exe is None:
        pytest.skip("pdftoppm is not installed (apt-get install poppler-utils); .ci/run installs it")
    return exe


# -- reports built once per session, shared by the HTML, PDF and browser tests -------------------
@pytest.fixture(scope="session")
def diverged_built(diverged_dir):
    """(trace, findings, report, html, pdf) of the diverged run."""
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.reports import build_report, render_html, render_pdf

    trace = load(diverged_dir)
    findings = analyze(trace)
    report = build_report(trace, findings)
    return trace, findings, report, render_html(report), render_pdf(report)


@pytest.fixture(scope="session")
def hostile_built(hostile_dir):
    """(trace, findings, report, html, pdf) of the hostile run, plus a finding that names its
    hostile parameters in every field (where, summary, evidence keys and values, advice)."""
    from torchautopsy.analyzer.findings import Finding
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.reports import build_report, render_html, render_pdf

    trace = load(hostile_dir)
    param = f"{HOSTILE_IMG}.weight"
    findings = analyze(trace) + [Finding(
        "vanishing_gradients", "warning", 2, [param, HOSTILE_SCRIPT], f"Tiny gradient in {param}.",
        {"early_grad_rms": {param: 1e-9}, HOSTILE_SCRIPT: HOSTILE_IMG}, f"Check {HOSTILE_SCRIPT}.", rank=0)]
    report = build_report(trace, findings)
    return trace, findings, report, render_html(report), render_pdf(report)
