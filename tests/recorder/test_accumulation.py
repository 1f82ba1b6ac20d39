"""Gradient accumulation: several forward/backward passes per optimizer step, rec.step() once
per optimizer step. Every micro-batch is measured and a NaN born in any one of them is found."""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

import torchautopsy
from tests.helpers import invoke_cli

MICRO = 4


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x + 5.0)  # finite unless its input falls below -5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), Sqrt(), nn.Linear(16, 1))


def _run(run_dir, plant=None, steps: int = 40, seen=None):
    """Train with MICRO micro-batches per optimizer step. plant(step, micro, x) may damage a
    micro-batch's input; seen[step] collects max |output| of model[2] over its micro-batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    losses, current = [], [0]
    if seen is not None:
        model[2].register_forward_hook(lambda m, i, o: seen.__setitem__(
            current[0], max(seen.get(current[0], 0.0), o.detach().abs().max().item())))
    with torchautopsy.Recorder(model, run_dir, profile_steps=0) as rec:
        for step in range(steps):
            current[0] = step
            opt.zero_grad()
            total = torch.zeros(())
            for micro in range(MICRO):
                x = torch.randn(8, 8, generator=g)
                if plant is not None:
                    x = plant(step, micro, x)
                loss = model(x).pow(2).mean() / MICRO
                loss.backward()
                total += loss.detach()
            opt.step()
            rec.step(loss=total)
            losses.append(total.item())
    return losses


def test_one_row_per_optimizer_step_over_every_micro_batch(tmp_path):
    seen: dict[int, float] = {}
    losses = _run(tmp_path, seen=seen)
    rt = torchautopsy.load(tmp_path).ranks[0]
    assert list(rt.step_index) == list(range(40))
    assert np.allclose(rt.steps["loss"].to_numpy(), losses, rtol=1e-6)
    assert (rt.steps["optimizer_steps"] == 1).all()
    # A watched step's module statistics cover all four micro-batches, not the last one only.
    out = rt.module_stat()["2"]
    watched = out[out >= 0]
    assert len(watched) >= 3
    for step, value in watched.items():
        assert np.isclose(value, seen[step], rtol=1e-6), step


def _nan_finding(tmp_path, run_dir) -> dict:
    out = tmp_path / "f.json"
    invoke_cli("analyze", str(run_dir), "--json", str(out))
    return next(f for f in json.loads(out.read_text())["findings"] if f["kind"] == "nonfinite")


def test_nan_input_in_one_micro_batch_is_dated(tmp_path):
    def plant(step, micro, x):
        if step == 25 and micro == 2:  # a step the recorder does not watch: found by the replay
            x[3, 1] = float("nan")
        return x
    _run(tmp_path / "run", plant)
    f = _nan_finding(tmp_path, tmp_path / "run")
    assert f["step"] == 25 and f["evidence"]["stage"] == "batch"


def test_nan_born_in_one_micro_batch_names_its_module(tmp_path):
    def plant(step, micro, x):
        # Inputs 1,000 times too large: the second Linear's output falls below -5 somewhere and
        # Sqrt makes NaN of it, in the third micro-batch only.
        return x * -1e3 if step in (23, 30) and micro == 2 else x
    _run(tmp_path / "run", plant)
    f = _nan_finding(tmp_path, tmp_path / "run")
    assert f["step"] == 23 and f["where"] == ["3"] and f["evidence"]["stage"] == "forward", f


def test_a_loop_that_clears_the_gradients_before_rec_step_records_those_the_update_used(tmp_path):
    """`opt.step(); opt.zero_grad(); rec.step()`: the gradients are gone at rec.step(); their norms
    are those the optimizer step pre-hook took, the same as in a loop that clears them after."""
    rows = {}
    for order in ("after", "before"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        with torchautopsy.Recorder(model, tmp_path / order, activations_every=4) as rec:
            for step in range(12):
                loss = model(torch.randn(8, 8, generator=g)).pow(2).mean()
                loss.backward()
                opt.step()
                if order == "before":
                    opt.zero_grad()
                rec.step(loss=loss)
                if order == "after":
                    opt.zero_grad()
        rows[order] = torchautopsy.load(tmp_path / order).ranks[0].param_stat("grad_norm").to_numpy()
    assert np.isfinite(rows["after"]).all() and (rows["after"] > 0).all()
    np.testing.assert_array_equal(rows["before"], rows["after"])
