"""The learning rate in the findings' evidence: an explosion dated against the schedule that
caused it (a warm-up to a learning rate too high, a spike), from real recorded training."""

from __future__ import annotations

import json

import torch
from torch import nn

import torchautopsy
from tests.helpers import invoke_cli
from tests.training import squared_error, train


def _train(run_dir, lr_at, steps: int = 60) -> None:
    """An MLP regression trained with SGD, its learning rate set by lr_at(step) before each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr_at(0))
    g = torch.Generator().manual_seed(0)

    def batch(step):
        x = torch.randn(64, 16, generator=g)
        return x, torch.sin(x[:, :1]) * 3

    train(model, run_dir, steps, batch, squared_error, optimizer=opt, lr_at=lr_at, profile_steps=0)


def _findings(run_dir, tmp_path) -> list[dict]:
    out = tmp_path / "f.json"
    r = invoke_cli("analyze", str(run_dir), "--json", str(out))
    assert r.returncode in (0, 1), r.stderr
    return json.loads(out.read_text())["findings"]


def test_explosion_after_a_warmup_names_it(tmp_path):
    # Linear warm-up from 0.01 to 0.3 over 20 steps: too high for this model; the gradients
    # grow from the end of the warm-up and explode a dozen steps later.
    _train(tmp_path / "run", lambda s: 0.3 if s >= 20 else 0.01 + (0.3 - 0.01) * s / 20)
    rt = torchautopsy.load(tmp_path / "run").ranks[0]
    assert rt.steps["lr"].iloc[20] == 0.3 and rt.steps["lr"].iloc[0] == 0.01
    found = {f["kind"]: f for f in _findings(tmp_path / "run", tmp_path)
             if f["kind"] in ("exploding_gradients", "loss_divergence")}
    assert set(found) == {"exploding_gradients", "loss_divergence"}
    for f in found.values():
        ev = f["evidence"]
        assert f["step"] > 20
        assert ev["lr_first"] == 0.01 and ev["lr_at_step"] == 0.3 and ev["warmup_end_step"] == 20
        assert "after the learning-rate warm-up ended at step 20" in f["summary"], f["summary"]


def test_explosion_during_the_warmup_says_so(tmp_path):
    _train(tmp_path / "run", lambda s: 2.0 if s >= 20 else 0.01 + (2.0 - 0.01) * s / 20)
    f = next(f for f in _findings(tmp_path / "run", tmp_path) if f["kind"] == "exploding_gradients")
    assert f["step"] < 20 and "while the learning rate was still warming up" in f["summary"], f["summary"]


def test_explosion_after_an_lr_spike_names_it(tmp_path):
    # A constant 0.01, then 4.0 from step 40 on (a schedule bug: a restart of the wrong scheduler).
    _train(tmp_path / "run", lambda s: 4.0 if s >= 40 else 0.01)
    found = [f for f in _findings(tmp_path / "run", tmp_path) if f["kind"] == "exploding_gradients"]
    assert len(found) == 1
    f = found[0]
    assert f["step"] >= 40 and f["evidence"]["lr_at_step"] == 4.0
    assert f["evidence"]["lr_spike_ratio"] == 400.0
    assert "jumped to 4" in f["summary"], f["summary"]


def test_steady_lr_adds_no_clause(tmp_path):
    """No schedule to blame: evidence holds the lr, the summary says nothing about it."""
    _train(tmp_path / "run", lambda s: 0.01)
    for f in _findings(tmp_path / "run", tmp_path):
        assert "learning rate" not in f["summary"] or f["kind"] == "update_ratio", f
