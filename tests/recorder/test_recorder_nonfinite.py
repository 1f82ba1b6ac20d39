"""Where NaN/Inf is born: steps/nonfinite_origin names the module that produced it (not the
ones that pass it on, not its parent), steps/batch_nonfinite flags a bad input batch, and
params/grad_nonfinite counts non-finite gradient elements exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from torchautopsy import Recorder

from recorder_testlib import names, open_trace
from tests.training import train

NAN_STEP = 5


class NaNAt(nn.Module):
    """Passes its input through, except on its NAN_STEP-th call, where it multiplies by NaN.

    Its call counter is a buffer: model state, which a replay of the step starts from (a Python
    attribute counted by the forward itself would not be, see test_unreproducible_nan_...)."""

    def __init__(self, at=NAN_STEP, inplace=False):
        super().__init__()
        self.at, self.inplace = at, inplace
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if int(self.calls) == self.at:
            x = x.mul_(float("nan")) if self.inplace else x * float("nan")
        self.calls += 1
        return x


class LogOf(nn.Module):
    """log(x + shift): finite while x + shift > 0; the test pushes it negative at one step."""

    def __init__(self):
        super().__init__()
        self.shift = 10.0

    def forward(self, x):
        return torch.log(x + self.shift)


class ParentMakesNaN(nn.Module):
    """A container whose own forward code (between its two children) produces the NaN."""

    def __init__(self, inplace=False):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.inplace = inplace
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.a(x)
        if int(self.calls) == NAN_STEP:
            h = h.mul_(float("nan")) if self.inplace else h * float("nan")
        self.calls += 1
        return self.b(h)


# Every module is hooked on watched steps only (every activations_every-th, 10 by default): at
# NAN_STEP the default recorder finds the origin by replaying the step on a copy of the model;
# with activations_every=1 the step is watched and its own hooks find it. Both must agree.
HOW = {"replayed": {}, "watched": {"activations_every": 1}}


@pytest.fixture(params=sorted(HOW))
def how(request):
    return HOW[request.param]


def _batch(step):
    """The batch of a step, the same in every run, drawing nothing from torch's own RNG."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _train(model, run_dir, n_steps, batch_fn=None, before_step=None, **options):
    def batch(step):
        return batch_fn(step, _batch(step)) if batch_fn else _batch(step)

    torch.manual_seed(0)
    train(model, run_dir, n_steps, batch, before_step=before_step, **options)  # SGD, lr 0.01
    with open_trace(run_dir / "rank0.h5") as f:
        return (names(f["modules/name"]), f["steps/nonfinite_origin"][:], f["steps/batch_nonfinite"][:],
                f["modules/output_absmax"][:])


def _origin_names(mnames, origin):
    return [mnames[i] if i >= 0 else None for i in origin]


def _nested_chain(producer):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 8), producer, nn.Tanh(), nn.Linear(8, 8)),
        nn.ReLU(),
        nn.Linear(8, 2),
    )


def test_origin_is_the_producing_module_not_later_ones_nor_its_parent(tmp_path, how):
    model = _nested_chain(NaNAt())
    mnames, origin, _, absmax = _train(model, tmp_path / "run", NAN_STEP + 1, **how)
    assert mnames[mnames.index("1.1")] == "1.1" and type(model[1][1]) is NaNAt
    got = _origin_names(mnames, origin)
    assert got[:NAN_STEP] == [None] * NAN_STEP
    assert got[NAN_STEP] == "1.1"
    # the evidence: its input (the output of 1.0) was finite, its output and all after not
    i = mnames.index
    assert np.isfinite(absmax[NAN_STEP, i("1.0")]) and np.isfinite(absmax[NAN_STEP, i("0")])
    for n in ("1.1", "1.2", "1.3", "1", "2", "3", ""):
        assert np.isnan(absmax[NAN_STEP, i(n)]), n


def test_origin_of_a_log_of_a_negative_value(tmp_path, how):
    model = _nested_chain(LogOf())
    log = model[1][1]

    def before_step(step):
        log.shift = -1e3 if step == NAN_STEP else 10.0

    mnames, origin, _, _ = _train(model, tmp_path / "run", NAN_STEP + 1, before_step=before_step, **how)
    got = _origin_names(mnames, origin)
    assert got == [None] * NAN_STEP + ["1.1"]


def test_origin_is_the_parent_when_its_own_code_makes_the_nan(tmp_path, how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ParentMakesNaN(), nn.ReLU(), nn.Linear(8, 2))
    mnames, origin, _, absmax = _train(model, tmp_path / "run", NAN_STEP + 1, **how)
    got = _origin_names(mnames, origin)
    assert got == [None] * NAN_STEP + ["1"]
    assert np.isfinite(absmax[NAN_STEP, mnames.index("1.a")])
    assert np.isnan(absmax[NAN_STEP, mnames.index("1.b")])


def test_origin_of_a_nan_from_the_root_forward_itself(tmp_path, how):
    """The root's own forward code (no child produced it) is module index 0, name ''."""
    torch.manual_seed(0)
    model = ParentMakesNaN()
    mnames, origin, batch_bad, _ = _train(model, tmp_path / "run", NAN_STEP + 1, **how)
    assert list(origin) == [-1] * NAN_STEP + [0] and mnames[0] == ""
    assert (batch_bad == 0).all()


@pytest.mark.parametrize("where", ["child", "parent"])
def test_origin_of_an_in_place_nan(tmp_path, how, where):
    torch.manual_seed(0)
    if where == "child":
        model = _nested_chain(NaNAt(inplace=True))
        expected = "1.1"
    else:
        model = nn.Sequential(nn.Linear(8, 8), ParentMakesNaN(inplace=True), nn.ReLU(), nn.Linear(8, 2))
        expected = "1"
    mnames, origin, _, _ = _train(model, tmp_path / "run", NAN_STEP + 1, **how)
    assert _origin_names(mnames, origin) == [None] * NAN_STEP + [expected]


def test_nan_in_the_input_batch(tmp_path, how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def batch_fn(step, x):
        if step == 3:
            x[1, 2] = float("nan")
        return x

    mnames, origin, batch_bad, _ = _train(model, tmp_path / "run", 6, batch_fn=batch_fn, **how)
    assert list(batch_bad) == [0, 0, 0, 1, 0, 0]
    assert list(origin[:3]) == [-1, -1, -1]
    assert origin[3] != -1  # something went non-finite at step 3 ...
    # ... and it was not born in a module: none of them saw finite inputs and made NaN.
    assert mnames[origin[3]] in ("0", "")


def test_grad_nonfinite_counts_exactly(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh(), nn.Linear(4, 2))
    target = model[2].weight  # 64 elements
    bad_step, n_nan, n_inf = 4, 3, 2
    state = {"step": 0}

    def poison(grad):
        if state["step"] != bad_step:
            return grad
        g = grad.clone()
        flat = g.view(-1)
        flat[[1, 7, 20]] = float("nan")
        flat[[30]] = float("inf")
        flat[[41]] = -float("inf")
        return g

    target.register_hook(poison)
    # The run stops at the bad step: the NaN has not spread to other gradients yet.
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_norms = []
    with Recorder(model, tmp_path / "run") as rec:
        for step in range(bad_step + 1):
            state["step"] = step
            x = torch.randn(4, 8)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            ref_norms.append([torch.linalg.vector_norm(p.grad).item() for p in model.parameters()])
            opt.step()
            rec.step(loss=loss)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        pnames = names(f["params/name"])
        counts = f["params/grad_nonfinite"][:]
        gn = f["params/grad_norm"][:]
    k = pnames.index("2.weight")
    expected = np.zeros_like(counts)
    expected[bad_step, k] = n_nan + n_inf
    np.testing.assert_array_equal(counts, expected)
    assert np.isnan(gn[bad_step, k])
    others = [j for j in range(len(pnames)) if j != k]
    assert np.isfinite(gn[:, others]).all() and np.isfinite(gn[:bad_step]).all()
    np.testing.assert_allclose(gn[:, others], np.array(ref_norms)[:, others], rtol=1e-5)


def test_grad_inf_only_is_counted(tmp_path):
    """An Inf without any NaN (norm = inf, not NaN) is still counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    model[0].bias.register_hook(lambda g: torch.where(torch.arange(5) < 2, torch.full_like(g, float("inf")), g))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Recorder(model, tmp_path / "run") as rec:
        loss = model(torch.randn(2, 3)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(loss=loss)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        pnames = names(f["params/name"])
        assert list(f["params/grad_nonfinite"][0]) == [2 if n == "0.bias" else 0 for n in pnames]
        assert f["params/grad_norm"][0, pnames.index("0.bias")] == np.inf
        assert f["params/grad_absmax"][0, pnames.index("0.bias")] == np.inf


class CausalMask(nn.Module):
    """Masks attention scores above the diagonal with -inf (what softmax then turns into 0)."""

    def forward(self, scores):
        t = scores.shape[-1]
        return scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.mask, self.softmax = CausalMask(), nn.Softmax(dim=-1)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.out(self.softmax(self.mask(scores)) @ x)


def _healthy_run_origins(model, run_dir, make_input, n_steps=3, **fwd_kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, run_dir) as rec:
        for step in range(n_steps):
            loss = model(make_input(), **fwd_kwargs).pow(2).mean()
            assert torch.isfinite(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    with open_trace(run_dir / "rank0.h5") as f:
        return names(f["modules/name"]), f["steps/nonfinite_origin"][:]


def test_causal_mask_in_transformer_encoder_is_not_a_nonfinite(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    mnames, origin = _healthy_run_origins(model, tmp_path / "run", lambda: torch.randn(2, 5, 8),
                                          mask=mask, is_causal=True)
    assert (origin == -1).all(), [mnames[i] for i in origin]


def test_module_returning_minus_inf_mask_is_not_a_nonfinite_origin(tmp_path):
    torch.manual_seed(0)
    mnames, origin = _healthy_run_origins(MaskedAttention(), tmp_path / "run", lambda: torch.randn(2, 4, 4))
    assert (origin == -1).all(), [mnames[i] for i in origin]


@pytest.mark.parametrize("at", [0, 3])  # a watched step, and one that is not
def test_overflowing_norm_of_finite_gradients_is_not_nonfinite(tmp_path, at):
    """Finite gradient elements (1e20) whose float32 norm overflows: the stored norm is finite
    (recomputed), grad_absmax exact, and nothing is counted as non-finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 1))
    state = {"step": 0}
    model[0].weight.register_hook(lambda g: torch.full_like(g, 1e20) if state["step"] == at else g)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with Recorder(model, tmp_path / "run") as rec:
        for step in range(at + 1):
            state["step"] = step
            loss = model(torch.randn(2, 4)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
        assert not torch.isfinite(torch.linalg.vector_norm(model[0].weight.grad))  # f32 overflows
        ref = torch.linalg.vector_norm(model[0].weight.grad, dtype=torch.float64).item()
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        k = names(f["params/name"]).index("0.weight")
        np.testing.assert_allclose(f["params/grad_norm"][at, k], ref, rtol=1e-5)
        np.testing.assert_allclose(f["params/grad_absmax"][at, k], 1e20, rtol=1e-6)
        assert (f["params/grad_nonfinite"][:] == 0).all()
        assert "blackbox" not in f or len(f["blackbox/step"]) == 0  # not a failure: nothing fired


class DropoutNaN(nn.Module):
    """Dropout, BatchNorm and a NaN born at NAN_STEP: the replay must restore the step's RNG
    and buffers on its copy, and leave the training's own untouched."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)
        self.nan, self.b = NaNAt(), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.nan(self.drop(self.bn(self.a(x)))))


def _dropout_run(run_dir):
    torch.manual_seed(0)
    model = DropoutNaN()
    losses = []
    train(model, run_dir, NAN_STEP + 3, lambda step: torch.randn(4, 8),
          after_step=lambda step, loss: losses.append(loss.item()))  # SGD, lr 0.01
    return model, losses, torch.get_rng_state()


def test_replay_finds_the_origin_and_leaves_the_training_as_it_was(tmp_path):
    model, losses, rng = _dropout_run(tmp_path / "run")
    bare, bare_losses, bare_rng = _dropout_run(None)
    # Training unchanged: losses (NaN from NAN_STEP on), RNG stream, weights and BatchNorm state.
    np.testing.assert_array_equal(losses, bare_losses)
    assert np.isnan(losses[NAN_STEP]) and np.isfinite(losses[:NAN_STEP]).all()
    assert torch.equal(rng, bare_rng)
    for (n, a), (_, b) in zip(model.state_dict().items(), bare.state_dict().items()):
        assert torch.equal(a, b) or (torch.isnan(a).all() and torch.isnan(b).all()), n
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        mnames = names(f["modules/name"])
        origin = f["steps/nonfinite_origin"][:]
        absmax = f["modules/output_absmax"][:]
        detail = f["blackbox/detail"][0].decode()
    assert [mnames[i] if i >= 0 else None for i in origin[:NAN_STEP + 1]] == [None] * NAN_STEP + ["nan"]
    assert "reproduced: module 'nan'" in detail
    # The replayed step's module outputs are in the trace: finite up to the dropout, NaN from "nan" on.
    i = mnames.index
    assert (absmax[NAN_STEP, [i("a"), i("bn"), i("drop")]] >= 0).all()
    assert np.isnan(absmax[NAN_STEP, [i("nan"), i("b"), i("")]]).all()
    assert (absmax[1:NAN_STEP] == -1).all()  # steps 1-4: not watched, not bad: not measured


class PythonCountedNaN(nn.Module):
    """A NaN that depends on a Python attribute the forward itself counts: a copy of the model
    taken after the step's forward has counted past it, so the replay cannot reproduce it."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(8, 2), 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (float("nan") if self.calls == NAN_STEP + 1 else 1.0)


def test_unreproducible_nan_is_reported_as_unchecked_not_blamed_on_the_loss(tmp_path):
    from tests.helpers import invoke_cli

    torch.manual_seed(0)
    _train(PythonCountedNaN(), tmp_path / "run", NAN_STEP + 2)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert f["steps/nonfinite_origin"][NAN_STEP] == -1
        assert "not reproduced" in f["blackbox/detail"][0].decode()
    out = tmp_path / "f.json"
    r = invoke_cli("analyze", tmp_path / "run", "--json", out)
    assert r.returncode == 0, r.stderr
    f = next(x for x in json.loads(out.read_text())["findings"] if x["kind"] == "nonfinite")
    assert f["step"] == NAN_STEP and f["evidence"]["stage"] == "unchecked"
    assert "activations_every=1" in f["advice"]


class DropoutLater(nn.Module):
    """A dropout that draws no random numbers until the test sets its p (p=0 draws none), and
    a NaN born at one step."""

    def __init__(self, at):
        super().__init__()
        self.a, self.drop, self.nan, self.b = nn.Linear(8, 8), nn.Dropout(0.0), NaNAt(at), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.nan(self.drop(torch.relu(self.a(x)))))


def _rng_run(run_dir, nan_step, dropout_from=None):
    """Train DropoutLater to its NaN and one step past it. Between steps the loop draws from
    torch's RNG (as a sampler or an augmentation does), so each step starts from other states.
    Returns the RNG state at each step's first forward, and the black box's tensors and detail."""
    from safetensors.torch import load_file

    from tests.helpers import invoke_cli

    torch.manual_seed(0)
    model = DropoutLater(nan_step)
    states = []

    def before_step(step):
        torch.randn(3)  # the data pipeline's draw
        if step == dropout_from:
            model.drop.p = 0.5
        states.append(torch.get_rng_state())

    train(model, run_dir, nan_step + 2, _batch, before_step=before_step, histogram_every=0, sample_every=0,
          snapshot_every=0)  # SGD, lr 0.01
    out = run_dir.parent / "blackbox.safetensors"
    r = invoke_cli("export", run_dir, "--tensors", "blackbox", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    with open_trace(run_dir / "rank0.h5") as f:
        detail = json.loads(f["blackbox/detail"][0].decode())
        assert f["blackbox/step"][0] == nan_step
        assert names(f["modules/name"])[f["steps/nonfinite_origin"][nan_step]] == "nan"
    return states, load_file(out), detail


def test_rng_states_of_a_step_that_draws_none_are_taken_when_the_box_fires(tmp_path):
    """Once watched steps (0, 10, 20) showed that a step draws no random numbers, the RNG states
    are no longer read at each step's first forward; a NaN at step 35 (not watched) still gets
    the states its forward started from, read when the black box fires, and its replay."""
    states, tensors, detail = _rng_run(tmp_path / "run", nan_step=35)
    assert detail["rng_at"] == "capture"
    assert torch.equal(tensors["rng.torch"], states[35])
    assert not torch.equal(states[35], states[34])  # (the test's draws between steps)
    assert "reproduced: module 'nan'" in detail["trigger_detail"]["origin_replay"]


def test_rng_states_are_read_again_once_a_watched_step_draws(tmp_path):
    """Dropout switched on at step 45: the watched step 50 sees the step draw, and from then on
    every step's states are read at its first forward again; the NaN of step 57 gets those."""
    states, tensors, detail = _rng_run(tmp_path / "run", nan_step=57, dropout_from=45)
    assert detail["rng_at"] == "first_forward"
    assert torch.equal(tensors["rng.torch"], states[57])
    assert "reproduced: module 'nan'" in detail["trigger_detail"]["origin_replay"]
