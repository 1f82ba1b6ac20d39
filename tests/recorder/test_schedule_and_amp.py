"""The optimizer's schedule in the trace (learning rate, hyper-parameters, AMP's loss scale and
skipped steps), and fp16/bf16 autocast training recorded as it runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import torchautopsy
from tests.helpers import invoke_cli
from tests.training import squared_error, train


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def _batch(g: torch.Generator, scale: float = 1.0):
    x = torch.randn(32, 16, generator=g) * scale
    return x, x.sum(1, keepdim=True)


def test_lr_and_hyperparams_are_those_each_update_used(tmp_path):
    """OneCycleLR moves the learning rate and the momentum of two param groups every step; the
    trace holds, for every step, the values the optimizer step of that step ran with."""
    model = _mlp()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2:].parameters(), "lr": 0.5}],
                          lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.01], total_steps=40)
    used = []  # (lr, momentum) per group, as each optimizer step saw them
    handle = register_optimizer_step_pre_hook(
        lambda o, a, k: used.append([(g["lr"], g["momentum"]) for g in o.param_groups]) if o is opt else None)
    g = torch.Generator().manual_seed(0)
    try:
        # sched.step() after the update, before rec.step(): the usual order
        train(model, tmp_path, 30, lambda step: _batch(g), squared_error, optimizer=opt,
              after_update=lambda step, loss: sched.step(), profile_steps=0)
    finally:
        handle.remove()
    rt = torchautopsy.load(tmp_path).ranks[0]
    assert np.array_equal(rt.steps["lr"].to_numpy(), [u[0][0] for u in used])
    assert (rt.steps["optimizer_steps"].to_numpy() == 1).all()
    assert list(rt.optimizers["class"]) == ["SGD"]
    hp = rt.hyperparams
    # Forward-fill the change log into one value per step, group and name.
    for group in (0, 1):
        for name, k in (("lr", 0), ("momentum", 1)):
            rows = hp[(hp["optimizer"] == 0) & (hp["group"] == group) & (hp["name"] == name)]
            series = rows.set_index("step")["value"].reindex(range(30)).ffill().to_numpy()
            assert np.array_equal(series, [u[group][k] for u in used]), (group, name)
    wd = hp[hp["name"] == "weight_decay"]
    assert len(wd) == 2 and (wd["step"] == 0).all()  # constant: written once per group
    # A change log: OneCycleLR moves lr and momentum every step, nothing else is repeated.
    assert set(hp[hp["step"] > 0]["name"]) == {"lr", "momentum"}


def _fp16_run(run_dir, lr: float, steps: int, input_scale=lambda s: 1.0, **options):
    """fp16 autocast with a GradScaler on the CPU; returns what the loop saw each step."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    stepped, scales, losses = [], [], []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: stepped.__setitem__(-1, True) if o is opt else None)
    g = torch.Generator().manual_seed(1)
    try:
        with torchautopsy.Recorder(model, run_dir, profile_steps=0, **options) as rec:
            for s in range(steps):
                x, y = _batch(g, input_scale(s))
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                stepped.append(False)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                rec.step(loss=loss)
                scales.append(scaler.get_scale())
                losses.append(loss.item())
    finally:
        handle.remove()
    return stepped, scales, losses


def test_gradscaler_startup_skips_are_not_failures(tmp_path):
    """Unnormalised inputs for the first steps: the scaled fp16 gradients overflow and the
    scaler skips those steps while it lowers its scale. The trace says so; no nonfinite error,
    no black box, and the run is healthy."""
    stepped, scales, _ = _fp16_run(tmp_path, 0.003, 40, input_scale=lambda s: 300.0 if s < 6 else 1.0)
    assert not all(stepped[:6]) and all(stepped[10:])  # the start-up really skipped steps
    rt = torchautopsy.load(tmp_path).ranks[0]
    assert np.array_equal(rt.steps["optimizer_steps"].to_numpy(), np.array(stepped, dtype=int))
    assert np.array_equal(rt.steps["loss_scale"].to_numpy(), np.array(scales, dtype=np.float32))
    assert np.array_equal(rt.amp_skipped, ~np.array(stepped))
    assert (rt.steps["lr"].to_numpy() == 0.003).all()
    assert len(rt.blackbox) == 0  # the scaler's skips fire nothing
    out = tmp_path / "f.json"
    r = invoke_cli("analyze", str(tmp_path), "--json", str(out), "--fail-on", "warning")
    findings = json.loads(out.read_text())["findings"]
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert not [f for f in findings if f["severity"] in ("warning", "error")]


def test_collapsing_loss_scale_is_a_finding(tmp_path):
    """A learning rate too high for the model under fp16: gradients grow, the scaler skips step
    after step and its scale falls below 1."""
    stepped, scales, _ = _fp16_run(tmp_path, 0.3, 60)
    out = tmp_path / "f.json"
    invoke_cli("analyze", str(tmp_path), "--json", str(out))
    found = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "loss_scale_collapse"]
    assert len(found) == 1, found
    f = found[0]
    first_below_one = next(s for s, v in enumerate(scales) if v < 1)
    # Dated at the start of the run of skips that took the scale below 1.
    assert not stepped[f["step"]] and f["step"] <= first_below_one
    assert all(not x for x in stepped[f["step"]:first_below_one + 1])
    assert f["severity"] == "error" and f["evidence"]["scale_min"] == pytest.approx(min(scales), rel=1e-6)
    assert f["evidence"]["lr_at_step"] == pytest.approx(0.3)


def test_explicit_scaler_is_used_when_several_exist(tmp_path):
    """With two scalers alive the recorder cannot tell which is the model's: the one given is used."""
    other = torch.amp.GradScaler("cpu", init_scale=8.0)
    other.scale(torch.ones(()))  # used: its scale exists
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(2)
    with torchautopsy.Recorder(model, tmp_path, profile_steps=0, scaler=scaler) as rec:
        for _ in range(5):
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            rec.step(loss=loss)
    assert (torchautopsy.load(tmp_path).ranks[0].steps["loss_scale"].to_numpy() == 2.0 ** 10).all()
    del other


def test_bf16_autocast_training_is_unchanged(tmp_path):
    """bf16 autocast needs no scaler: the recorded run's losses are bit-identical to the bare run."""
    def run(record: bool):
        model = _mlp(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(3)
        rec = torchautopsy.Recorder(model, tmp_path / "rec", profile_steps=0) if record else None
        losses = []
        for _ in range(25):
            x, y = _batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rec:
                rec.step(loss=loss)
            losses.append(loss.item())
        if rec:
            rec.close()
        return losses

    bare, recorded = run(False), run(True)
    assert bare == recorded
    rt = torchautopsy.load(tmp_path / "rec").ranks[0]
    assert np.allclose(rt.steps["loss"].to_numpy(), recorded, rtol=1e-6)
    assert math.isnan(rt.steps["loss_scale"].iloc[0]) and (rt.steps["lr"] == 1e-3).all()


def _watched_after(tmp_path, name: str, jump_at: int, lr_jump: float = 1.0, data_jump: float = 1.0,
                   steps: int = 260) -> list[int]:
    """Watched steps (activations sampled) after step 100 of a run whose lr or data jumps."""
    model = _mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)

    def jump(step):
        if step == jump_at:
            for group in opt.param_groups:
                group["lr"] *= lr_jump

    # watch_budget tiny: after the warm-up the schedule is as sparse as it goes (50 apart)
    train(model, tmp_path / name, steps, lambda step: _batch(g, data_jump if step >= jump_at else 1.0),
          squared_error, optimizer=opt, before_step=jump, watch_budget=1e-6)
    watched = torchautopsy.load(tmp_path / name).ranks[0].sample_steps("activations")
    return [int(s) for s in watched if s > 100]


def test_a_jump_of_the_lr_or_the_loss_is_watched_densely_after(tmp_path):
    """After a jump (lr x10, or inputs x30 so the loss jumps) the next step and 4 more, 10 apart,
    are watched: what follows a jump is dated to ~10 steps, not the sparse schedule's 50."""
    quiet = _watched_after(tmp_path, "quiet", jump_at=10**6)
    assert all(b - a >= 50 for a, b in zip(quiet, quiet[1:])), quiet  # no jump: the sparse schedule
    for name, kw in (("lr", {"lr_jump": 10.0}), ("loss", {"data_jump": 30.0})):
        watched = _watched_after(tmp_path, name, jump_at=130, **kw)
        assert [s for s in watched if 130 <= s <= 172] == [131, 141, 151, 161, 171], (name, watched)
