"""Recording a torch.compile'd model (issue 21): it trains exactly as the same compiled model
without the recorder, the model is compiled once, and the trace says what was not measured.

Compiled frames run no hook and no function wrapper of the recorder (they return at once while
Dynamo traces them: recorder/forward/wrapped_functions.py, module_watcher.py), so the per-module rows of a compiled
forward read -1 ("not measured") and its time split NaN; the loss, gradient and parameter norms
(taken outside the compiled code) are recorded on every step as in eager mode.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import h5py
import numpy as np
import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch import nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from torchautopsy import Recorder
import torchautopsy.recorder

STEPS = 30
RECORDER_DIR = os.path.dirname(torchautopsy.recorder.__file__)


def make_mlp() -> nn.Module:
    """The model of the report: five Linear + ReLU layers and a head."""
    layers = []
    for _ in range(5):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, 1))


class Mixed(nn.Module):
    """Every kind of call the recorder wraps or hooks: F.relu, F.gelu, torch.tanh, an
    nn.MultiheadAttention called with need_weights=False, F.scaled_dot_product_attention."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.act = nn.ReLU()
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = F.gelu(self.inp(x))
        h = h + self.mha(h, h, h, need_weights=False)[0]
        q = h.view(h.shape[0], h.shape[1], 2, 8).transpose(1, 2)
        h = h + F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(h.shape)
        return self.out(torch.tanh(self.act(h))).mean(dim=1)


def data(step: int, shape=(16, 32)):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(*shape, generator=g), torch.randn(shape[0], 1, generator=g)


def run(make=make_mlp, order="before", record=True, steps=STEPS, shape=(16, 32), on_step=None,
        options=None, census=False, **compile_kw):
    """Train `steps` steps of a freshly compiled model (torch.compile `order` "before" or
    "after" the Recorder). Returns the losses, the number of graphs Dynamo had made after each
    step, the run directory and the recorder's warnings."""
    torch._dynamo.reset()  # each run compiles afresh (and the recompile limit is per code object)
    counters.clear()
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run_dir = tempfile.mkdtemp(prefix="compile_") if record else None
    fwd = model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order in ("before", "given"):
            fwd = torch.compile(model, **compile_kw)
        # ("given": the Recorder is handed the compiled module itself)
        rec = Recorder(fwd if order == "given" else model, run_dir, **(options or {})) if record else None
        if order == "after":
            fwd = torch.compile(model, **compile_kw)
        losses, graphs = [], []
        for step in range(steps):
            x, y = data(step, shape)
            loss = F.mse_loss(fwd(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rec is not None:
                rec.step(loss=loss)
                if on_step is not None:
                    on_step(rec)
            losses.append(loss.detach().clone())
            graphs.append(counters["stats"]["unique_graphs"])
        if rec is not None:
            rec.close()
    # The recorder's warnings, and any warning raised from its code (torch's included), but the
    # census's known one (see the last test), unless asked for.
    ours = [str(w.message) for w in caught
            if ("torchautopsy" in str(w.message) or w.filename.startswith(RECORDER_DIR))
            and (census or "data pointer of FakeTensor" not in str(w.message))]
    return torch.stack(losses), graphs, run_dir, ours


@pytest.fixture(scope="module", autouse=True)
def _no_precompiled_header():
    """Inductor precompiles its C++ kernels' header (~7 CPU-s of g++) into a directory fixed when
    it is imported: under this session's temporary directory, so every session built it again,
    though the kernels themselves come from the persistent cache. Without it the kernels are
    the same code, compiled the same (only their build is slower, when one is not cached)."""
    with torch._inductor.config.patch(cpp_cache_precompile_headers=False):
        yield


_baselines: dict = {}


def baseline(mode):
    if mode not in _baselines:
        _baselines[mode] = run(record=False, mode=mode)
    return _baselines[mode]


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize("order", ["before", "after", "given"])
def test_inductor_compiled_model_records_and_trains_unchanged(mode, order):
    base_losses, base_graphs, _, _ = baseline(mode)
    watched = []
    losses, graphs, run_dir, ours = run(order=order, mode=mode, options={"activations_every": 5},
                                        on_step=lambda rec: watched.append(rec.watcher.watching))
    assert ours == []
    assert torch.equal(losses, base_losses), (losses - base_losses).abs().max()
    # No compilation added, at any step (Dynamo's own count): the root's hooks and the black box
    # run eagerly, outside the graph, and the inner modules' hooks stay once traced (issue 36).
    assert graphs == base_graphs, (graphs, base_graphs)
    steady = slice(STEPS // 2, STEPS)
    assert sum(watched[steady]) >= 2  # (watched[k]: step k + 1 is watched)

    with h5py.File(f"{run_dir}/rank0.h5", "r") as f:
        assert np.array_equal(f["steps/loss"][:], losses.double().numpy())
        assert np.isfinite(f["params/grad_norm"][:]).all() and (f["params/grad_norm"][:] > 0).all()
        # Watched steps measured the parameters, outside the compiled code ...
        assert ((f["params/param_norm"][:] > 0).all(axis=1)).sum() >= 4
        # ... and the model's own output (its root's hooks run eagerly) and forward time, but no
        # inner module's output: the forward ran compiled, and says so (-1: not measured).
        outs = f["modules/output_absmax"][:]
        assert (outs[:, 1:] == -1).all() and (outs[::5, 0] > 0).all()
        assert np.isfinite(f["steps/forward_s"][:]).all()
        assert f["activity_sites/module"].shape[0] == 0


def _model_graphs(seen):
    """Graphs holding the model's matrix products (not the black box's small ones)."""
    return sum(any(n.op == "call_function" and "linear" in str(n.target) for n in gm.graph.nodes)
               for gm in seen)


@pytest.mark.parametrize("order", ["before", "after", "given"])
def test_model_graph_compiled_once(order):
    """A watched step every third step (in eager mode: every module hooked, then unhooked) does
    not recompile the model: it is compiled once, as without the recorder (Dynamo guards on the
    number of a module's hooks)."""
    def counting(seen):
        def backend(gm, example_inputs):
            seen.append(gm)
            return gm.forward
        return backend

    if "graph_once" not in _baselines:  # (without a Recorder, every order is the same run)
        base = []
        _baselines["graph_once"] = base, run(record=False, backend=counting(base))[0]
    (base, base_losses), mine = _baselines["graph_once"], []
    watched = []
    losses, _, _, ours = run(order=order, backend=counting(mine), options={"activations_every": 3},
                             on_step=lambda rec: watched.append(rec.watcher.watching))
    assert ours == [] and sum(watched) >= 8
    assert torch.equal(losses, base_losses)
    assert _model_graphs(base) == 1
    assert _model_graphs(mine) == 1, [gm.code for gm in mine]


def test_nothing_of_the_recorder_is_traced():
    """fullgraph=True: any graph break is an error. With every step watched (every module
    hooked, every wrapped function observed) and the black box keeping the step's input, the
    hooks and wrappers add nothing to the graph."""
    kw = dict(make=Mixed, shape=(4, 6, 8), backend="aot_eager", fullgraph=True)
    base_losses, *_ = run(record=False, **kw)
    losses, graphs, run_dir, ours = run(options={"activations_every": 1, "attention_every": 1}, **kw)
    assert ours == []
    assert torch.equal(losses, base_losses)
    assert graphs[-1] == 1
    with h5py.File(f"{run_dir}/rank0.h5", "r") as f:
        assert f["attention_sites/module"].shape[0] == 0  # not seen inside compiled code
        assert f["activity_sites/module"].shape[0] == 0


@torch.compiler.disable
def _eager_relu(x):
    return F.relu(x)  # runs eagerly inside the compiled forward: the wrapper observes it


class Island(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 1)

    def forward(self, x):
        return self.b(_eager_relu(self.a(x)))


def test_a_recorder_fault_under_compile_stops_the_recorder_not_the_training(monkeypatch):
    from torchautopsy.recorder.forward import unit_activity

    def broken(self, *args):
        raise RuntimeError("observer broke")

    base_losses, *_ = run(make=Island, record=False, backend="aot_eager")
    monkeypatch.setattr(unit_activity.ActivityTracker, "on_activation", broken)
    losses, _, run_dir, ours = run(make=Island, backend="aot_eager", options={"activations_every": 1})
    assert torch.equal(losses, base_losses)
    assert len(ours) == 1 and "\n" not in ours[0] and "observer broke" in ours[0], ours
    with h5py.File(f"{run_dir}/rank0.h5", "r") as f:
        assert "recorder error" in str(f.attrs["end_reason"])


def test_nonfinite_origin_found_under_compile():
    """A step whose output goes non-finite is replayed eagerly on a copy of the model (the black
    box kept its input): the module that made the Inf is named though the forward ran compiled."""
    def poison(rec):
        if rec._step == 12:  # before step 12's forward
            with torch.no_grad():
                rec.model[4].weight[0, 0] = float("inf")

    losses, _, run_dir, ours = run(backend="aot_eager", steps=16, on_step=poison)
    with h5py.File(f"{run_dir}/rank0.h5", "r") as f:
        origin = f["steps/nonfinite_origin"][:]
        names = [n.decode() if isinstance(n, bytes) else n for n in f["modules/name"][:]]
    assert not torch.isfinite(losses[12]) and ours == []
    assert names[origin[12]] == "4" and (origin[:12] == -1).all()


def test_census_after_compilation_warns_nothing():
    """The tensor census skips the FakeTensors inductor's compiled graphs keep alive (calling
    data_ptr() on one makes torch warn)."""
    torch.set_warn_always(True)  # (torch warns once a process: this test must not depend on order)
    try:
        _, _, _, ours = run(steps=12, options={"census_every": 5, "census_budget": 1.0}, census=True)
    finally:
        torch.set_warn_always(False)
    assert ours == []
