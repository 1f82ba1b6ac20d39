"""Issue 6: parameter snapshots, histograms, sampled tensors and the black box, end to end.

A real run in which NaN is born at a known step in a known module; the trace's black box, taken
out with the real CLI as safetensors, loads into the same model and reproduces the bad step."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
import torch.nn.functional as F

from torchautopsy import Recorder, load
from torchautopsy.recorder.reductions.histograms import N_BINS, NAN_BIN, NEG_INF_BIN, POS_INF_BIN, ZERO_BIN, histogram

from tests.helpers import invoke_cli
from tests.recorder.recorder_testlib import Net
from tests.training import train

BAD_STEP = 7


def _batch(step):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(16, 8, generator=g)
    if step == BAD_STEP:
        x = x * 1e3
    return x, torch.randint(0, 3, (16,), generator=g)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """Adam, 12 steps, NaN born in `expo` at BAD_STEP. The test keeps the state_dict at the start
    of every step, the optimizer state, and what `expo` and `fc1` output at the bad step."""
    run_dir = tmp_path_factory.mktemp("nan") / "run"
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = {}
    model.expo.register_forward_hook(lambda m, a, out: seen.__setitem__("expo", out.detach().clone()))
    model.fc1.register_forward_hook(lambda m, a, out: seen.__setitem__("fc1", out.detach().clone()))
    kept = {}
    with Recorder(model, run_dir, histogram_every=1, sample_every=5, snapshot_every=4) as rec:
        for step in range(12):
            x, y = _batch(step)
            if step == BAD_STEP:
                kept["state"] = copy.deepcopy(model.state_dict())
                kept["exp_avg"] = opt.state[model.fc1.weight]["exp_avg"].clone()
                kept["x"] = x.clone()
            loss = F.cross_entropy(model(x), y)
            if step == BAD_STEP:
                kept["expo"], kept["fc1"] = seen["expo"], seen["fc1"]
                assert not torch.isfinite(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    return run_dir, kept


def test_blackbox_holds_the_state_and_inputs_of_the_bad_step(nan_run):
    run_dir, kept = nan_run
    bb = load(run_dir).ranks[0].blackbox
    assert len(bb) == 1
    row = bb.iloc[0]
    assert int(row["step"]) == BAD_STEP
    assert row["trigger"] == "grad_nonfinite" and row["params_at"] == "start_of_step"
    assert "fc1.weight" in row["detail"]["affected"]
    assert row["detail"]["optimizer"] == "Adam"


def test_exported_blackbox_reproduces_the_bad_step(nan_run, tmp_path):
    run_dir, kept = nan_run
    p_out, t_out = tmp_path / "params.safetensors", tmp_path / "inputs.safetensors"
    # The analyzer's side runs without torch, as on a laptop.
    r = invoke_cli("export", run_dir, "--params", "blackbox", p_out, "--tensors", "blackbox", t_out, block_torch=True)
    assert r.returncode == 0, r.stderr
    assert "before its bad update" in r.stdout
    params, tensors = load_file(p_out), load_file(t_out)
    # Exactly the state (parameters and BatchNorm buffers) the bad step started from.
    assert params.keys() == kept["state"].keys()
    for k, v in kept["state"].items():
        assert torch.equal(params[k], v), k
    assert torch.equal(tensors["forward0.args.0"], kept["x"])
    assert torch.equal(tensors["optimizer.fc1.weight.exp_avg"], kept["exp_avg"])
    assert not torch.isfinite(tensors["grad.fc1.weight"]).all()
    assert {"rng.torch", "rng.numpy.keys", "rng.python"} <= tensors.keys()

    # A fresh model (other weights) loads them and, given the exported input, reproduces the
    # bad step: the same fc1 output bit for bit, and the same non-finite output in `expo`.
    torch.manual_seed(99)
    fresh = Net()
    assert not torch.equal(fresh.fc1.weight, params["fc1.weight"])
    fresh.load_state_dict(params, strict=True)
    got = {}
    fresh.expo.register_forward_hook(lambda m, a, out: got.__setitem__("expo", out.detach()))
    fresh.fc1.register_forward_hook(lambda m, a, out: got.__setitem__("fc1", out.detach()))
    fresh.train()
    fresh(tensors["forward0.args.0"])
    assert torch.equal(got["fc1"], kept["fc1"])
    assert not torch.isfinite(got["expo"]).all()
    assert torch.equal(torch.isfinite(got["expo"]), torch.isfinite(kept["expo"]))
    # ... and the reproduction depends on what was exported: the fresh model's own weights with
    # the same input give another fc1 output; the exported weights with a normal batch stay finite.
    torch.manual_seed(99)
    other = Net()
    other.fc1.register_forward_hook(lambda m, a, out: got.__setitem__("fc1_other", out.detach()))
    other(tensors["forward0.args.0"])
    assert not torch.equal(got["fc1_other"], kept["fc1"])
    fresh(_batch(0)[0])
    assert torch.isfinite(got["expo"]).all()


def test_snapshots_export_and_load(nan_run, tmp_path):
    run_dir, _ = nan_run
    rt = load(run_dir).ranks[0]
    # step 0 (the initial weights), every 4th step, and the final weights at close
    assert list(rt.snapshots["step"]) == [0, 4, 8, 12]
    out = tmp_path / "s4.safetensors"
    r = invoke_cli("export", run_dir, "--params", "4", out)
    assert r.returncode == 0, r.stderr
    state = load_file(out)
    model = Net()
    model.load_state_dict(state, strict=True)
    assert state["bn.num_batches_tracked"].item() == 4
    r = invoke_cli("export", run_dir, "--params", "last", out, "--force")
    assert r.returncode == 0 and "step 12" in r.stdout, r.stdout + r.stderr
    assert not torch.isfinite(load_file(out)["fc1.weight"]).all()  # the run ended NaN


def test_sampled_tensors(nan_run, tmp_path):
    run_dir, _ = nan_run
    out = tmp_path / "s.safetensors"
    r = invoke_cli("export", run_dir, "--tensors", "5", out)
    assert r.returncode == 0, r.stderr
    t = load_file(out)
    # default modules: the first, middle and last leaf modules with weights
    assert set(t) == {f"{m}.{k}" for m in ("fc1", "fc2", "head") for k in ("activation", "grad")}
    assert t["fc1.activation"].shape == (4, 16)  # sample_rows=4 rows of the batch
    assert t["head.grad"].shape == (4, 3)


def test_histograms_count_nan_and_inf(nan_run):
    run_dir, kept = nan_run
    rt = load(run_dir).ranks[0]
    steps, names, counts = rt.histograms("activation")
    assert counts.shape == (12, len(names), N_BINS)
    expo = counts[list(steps).index(BAD_STEP), names.index("expo")]
    x = kept["expo"]
    assert expo.sum() == x.numel()
    assert expo[POS_INF_BIN] == int(torch.isinf(x).sum()) > 0
    steps, names, g = rt.histograms("grad")
    assert g[list(steps).index(BAD_STEP), names.index("fc1.weight"), NAN_BIN] > 0
    lower, upper = rt.histogram_bins
    assert lower.size == N_BINS and np.isinf(lower[POS_INF_BIN])


def test_the_bad_step_gets_histograms_when_the_black_box_fires(tmp_path):
    """With the default schedule (histograms every 100th step) the step where NaN is born is not
    a histogram step; its weights and gradients are histogrammed anyway, once, as the black box
    fires (module outputs were not hooked that step: their counts read 'not recorded')."""
    torch.manual_seed(0)
    model = Net()
    run_dir = train(model, tmp_path / "run", 12, lambda s: _batch(s + 3), loss_fn=F.cross_entropy,
                    optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))  # step 4 is BAD_STEP's batch
    rt = load(run_dir).ranks[0]
    assert rt.blackbox is not None and int(rt.blackbox["step"].iloc[0]) == BAD_STEP - 3
    assert list(rt.histogram_steps) == [0, BAD_STEP - 3]  # step 0 as scheduled; the bad one; no later
    steps, names, g = rt.histograms("grad")
    assert g[1, names.index("fc1.weight"), NAN_BIN] > 0 and g[0, :, NAN_BIN].sum() == 0
    _, wnames, w = rt.histograms("weight")
    assert w[1, wnames.index("fc1.weight")].sum() == model.fc1.weight.numel()
    _, _, act = rt.histograms("activation")
    assert (act[1] == -1).all()


def test_histogram_bins():
    x = torch.tensor([float("nan"), float("-inf"), float("inf"), 0.0, 1e-30, -1.0, 1.0, 1.5, 3.0, 1e30, -1e30],
                     dtype=torch.float32)
    h = histogram(x)
    assert h.sum() == x.numel()
    assert h[NAN_BIN] == 1 and h[NEG_INF_BIN] == 1 and h[POS_INF_BIN] == 1
    assert h[ZERO_BIN] == 2  # 0 and 1e-30 (below 2**-40)
    assert h[POS_INF_BIN - 1] == 1 and h[NEG_INF_BIN + 1] == 1  # finite overflow: outermost bins
    # 1.0 and 1.5 share the half-octave [1, 1.414)? no: 1.5 is in [1.414, 2)
    one = ZERO_BIN + 1 + 40 * 2
    assert h[one] == 1 and h[one + 1] == 1 and h[one + 3] == 1 and h[ZERO_BIN - 1 - 40 * 2] == 1
    assert torch.equal(histogram(x.to(torch.bfloat16)), h)


def test_blackbox_on_exception_and_manual_update(tmp_path):
    torch.manual_seed(0)
    model = Net()
    with pytest.raises(RuntimeError, match="boom"):
        with Recorder(model, tmp_path / "exc") as rec:
            for step in range(3):
                x, y = _batch(step)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                with torch.no_grad():  # a hand-written update, no optimizer
                    for p in model.parameters():
                        p -= 0.01 * p.grad
                        p.grad = None
                if step == 2:
                    raise RuntimeError("boom")
                rec.step(loss=loss)
    bb = load(tmp_path / "exc").ranks[0].blackbox
    assert list(bb["trigger"]) == ["exception"] and int(bb["step"].iloc[0]) == 2
    assert bb["params_at"].iloc[0] == "at_exit"
    # a manual update: no optimizer step to see it, so the box fires at rec.step(), after the update
    torch.manual_seed(0)
    model = Net()
    with Recorder(model, tmp_path / "manual", blackbox=True) as rec:
        for step in range(BAD_STEP + 2):
            x, y = _batch(step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            rec.step(loss=loss)
            model.zero_grad()
    bb = load(tmp_path / "manual").ranks[0].blackbox
    assert int(bb["step"].iloc[0]) == BAD_STEP and bb["params_at"].iloc[0] == "end_of_step"


def test_disk_budget_honoured_on_a_long_run(tmp_path):
    """300 steps, a snapshot every 10: the ring keeps the first and the newest within budget."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    one = sum(p.numel() * 4 for p in model.parameters())  # 2,388 floats: 9,552 bytes
    budget = 5 * one + 100
    train(model, tmp_path / "run", 300, lambda step: torch.randn(8, 32), lambda out: out.square().mean(),
          snapshot_every=10, snapshot_budget_bytes=budget, histogram_every=0, sample_every=0,
          profile_steps=0)  # SGD, lr 0.01
    with h5py.File(tmp_path / "run" / "rank0.h5") as f:
        assert f["snapshots/bytes"].shape[0] <= budget
        assert f["snapshots/step"].shape[0] == 31  # 30 scheduled + step 0; 300 is also 30 x 10
    rt = load(tmp_path / "run").ranks[0]
    assert list(rt.snapshots["step"]) == [0, 270, 280, 290, 300]
    out = tmp_path / "first.safetensors"
    assert invoke_cli("export", tmp_path / "run", "--params", "0", out).returncode == 0
    assert load_file(out).keys() == model.state_dict().keys()
    r = invoke_cli("export", tmp_path / "run", "--params", "100", out, "--force")
    assert r.returncode == 2 and "no snapshot of step 100" in r.stderr and "270" in r.stderr


def test_half_precision_and_bfloat16_snapshots(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.bfloat16)
    with Recorder(model, tmp_path / "bf", histogram_every=0, sample_every=0):
        pass
    out = tmp_path / "bf.safetensors"
    assert invoke_cli("export", tmp_path / "bf", "--params", "0", out, block_torch=True).returncode == 0
    state = load_file(out)
    for k, v in model.state_dict().items():
        assert state[k].dtype == torch.bfloat16 and torch.equal(state[k], v), k
    model = nn.Linear(4, 4)
    with Recorder(model, tmp_path / "half", snapshot_dtype="float16"):
        pass
    assert invoke_cli("export", tmp_path / "half", "--params", "last", out, "--force").returncode == 0
    assert load_file(out)["weight"].dtype == torch.float16
    assert torch.equal(load_file(out)["weight"], model.weight.detach().half())


def test_export_errors(nan_run, tmp_path):
    run_dir, _ = nan_run
    from tests.cli.test_bad_input import assert_one_line_error

    assert_one_line_error(invoke_cli("export", run_dir, "--params", "soon", tmp_path / "o"), "WHICH must be")
    assert_one_line_error(invoke_cli("export", run_dir, "--tensors", "3", tmp_path / "o"), "no sampled tensors of step 3")
    assert_one_line_error(invoke_cli("export", run_dir, "--params", "0", tmp_path / "no" / "o"), "cannot write")
    torch.manual_seed(0)
    with Recorder(nn.Linear(2, 2), tmp_path / "off", snapshot_every=0, blackbox=False, sample_every=0):
        pass
    assert_one_line_error(invoke_cli("export", tmp_path / "off", "--params", "last", tmp_path / "o"), "no parameter snapshots")
    assert_one_line_error(invoke_cli("export", tmp_path / "off", "--params", "blackbox", tmp_path / "o"), "no black box")
    r = invoke_cli("info", tmp_path / "off")
    assert r.returncode == 0 and "off (blackbox=False)" in r.stdout


def test_analyze_points_at_the_black_box(nan_run):
    run_dir, _ = nan_run
    r = invoke_cli("analyze", run_dir, block_torch=True)
    assert r.returncode == 0, r.stderr
    assert "black box: rank 0 kept step 7 (grad_nonfinite), parameters before its bad update" in r.stdout
    assert "--params blackbox params.safetensors --tensors blackbox inputs.safetensors" in r.stdout


def test_info_lists_what_the_trace_holds(nan_run):
    run_dir, _ = nan_run
    r = invoke_cli("info", run_dir)
    assert r.returncode == 0, r.stderr
    assert "fired at step 7 (grad_nonfinite)" in r.stdout
    assert "the parameters at steps 0, 4, 8, 12 " in r.stdout
    assert "12 steps (every 1)" in r.stdout


def test_optimizer_hook_removed_and_others_ignored(tmp_path):
    """The optimizer pre-hook goes with close(); an optimizer of another model is ignored."""
    from torchautopsy.recorder.optimizer.global_hooks import _pre as _global_optimizer_pre_hooks

    before = len(_global_optimizer_pre_hooks)
    model, other = Net(), nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=1.0)
    with Recorder(model, tmp_path / "run") as rec:
        assert len(_global_optimizer_pre_hooks) == before + 1
        other(torch.full((1, 2), float("nan"))).sum().backward()
        other_opt.step()  # NaN gradients, but not the watched model's
        assert rec.captures.armed
    assert len(_global_optimizer_pre_hooks) == before


def test_skipped_optimizer_step_does_not_fire_and_budget_too_small(tmp_path):
    """Inf gradients whose optimizer step is skipped (what AMP's GradScaler does on overflow) are
    never applied: the black box stays armed. A model larger than the budget gets no snapshot."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, tmp_path / "run", snapshot_budget_bytes=100) as rec:
        for step in range(6):
            x, y = _batch(step if step != BAD_STEP else 0)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            if step == 3:
                model.fc1.weight.grad[0, 0] = float("inf")  # an overflowed (scaled) gradient
            else:
                opt.step()
            rec.step(loss=loss)
        assert rec.captures.armed
    rt = load(tmp_path / "run").ranks[0]
    assert len(rt.blackbox) == 0 and len(rt.snapshots) == 0
    assert int(rt.param_stat("grad_nonfinite")["fc1.weight"].iloc[3]) == 1  # still recorded
    r = invoke_cli("info", tmp_path / "run")
    assert "armed, never fired" in r.stdout and "exceeds snapshot_budget_bytes (100)" in r.stdout


def test_torn_snapshot_slot_is_refused(tmp_path):
    """A slot rewritten when the job was killed no longer matches its row's crc32: the export
    says so in one line instead of handing out a mix of two snapshots."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    with Recorder(model, tmp_path / "run", histogram_every=0, sample_every=0):
        pass
    with h5py.File(tmp_path / "run" / "rank0.h5", "r+") as f:
        f["snapshots/bytes"][10] ^= 0xFF  # what a half-rewritten slot looks like
    from tests.cli.test_bad_input import assert_one_line_error

    assert_one_line_error(invoke_cli("export", tmp_path / "run", "--params", "0", tmp_path / "o"),
                          "snapshot of step 0 is incomplete")


def test_blackbox_rng_state_reproduces_dropout(tmp_path):
    """A transformer with dropout: the exported torch RNG state, taken at the bad step's first
    forward, makes the re-run forward identical bit for bit (and without it, it is not)."""
    from recorder_testlib import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen = {}
    model.head.register_forward_hook(lambda m, a, out: seen.__setitem__("head", out.detach().clone()))
    with Recorder(model, tmp_path / "run", histogram_every=0, sample_every=0, snapshot_every=0) as rec:
        for step in range(7):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 6, 5, generator=g), torch.randint(0, 3, (4,), generator=g)
            out = model(x)
            if step == 5:
                kept = seen["head"]
                out = out * float("nan")  # the loss goes NaN; the forward itself was finite
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    p, t = tmp_path / "p.safetensors", tmp_path / "t.safetensors"
    r = invoke_cli("export", tmp_path / "run", "--params", "blackbox", p, "--tensors", "blackbox", t)
    assert r.returncode == 0, r.stderr
    params, tensors = load_file(p), load_file(t)
    again = TinyTransformer()
    again.load_state_dict(params)
    again.train()
    got = {}
    again.head.register_forward_hook(lambda m, a, out: got.__setitem__("head", out.detach()))
    torch.set_rng_state(tensors["rng.torch"])
    again(tensors["forward0.args.0"])
    assert torch.equal(got["head"], kept)
    again(tensors["forward0.args.0"])  # other dropout masks
    assert not torch.equal(got["head"], kept)


def test_blackbox_follows_buffers_replaced_mid_run(tmp_path):
    """model.double() halfway replaces the BatchNorm buffers: the black box's copy of them at
    the start of the bad step is of the new buffers, in float64, exactly."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    kept = {}
    with Recorder(model, tmp_path / "run") as rec:
        for step in range(BAD_STEP + 1):
            if step == 4:
                model.double()  # new buffer objects; the parameters keep theirs
            x, y = _batch(step)
            if step >= 4:
                x = x.double()
            if step == BAD_STEP:
                kept = copy.deepcopy(model.state_dict())
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    p_out = tmp_path / "params.safetensors"
    r = invoke_cli("export", tmp_path / "run", "--params", "blackbox", p_out, block_torch=True)
    assert r.returncode == 0, r.stderr
    params = load_file(p_out)
    assert params["bn.running_mean"].dtype == torch.float64
    for k, v in kept.items():
        assert torch.equal(params[k], v), k
