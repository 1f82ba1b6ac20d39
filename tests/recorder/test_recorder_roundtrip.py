"""Round trip: train real models with the Recorder, read the HDF5 trace back, compare every
recorded number with a reference the test computes itself from the same tensors."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchautopsy import Recorder
from torchautopsy.recorder.planner import StepPlanner

from recorder_testlib import WATCHED, attr_str, batch, build, hooks_left, names, open_trace
from tests.training import train

N_STEPS = 12  # two activation / update-ratio samples at the default schedule: steps 0 and 10


def _train_with_references(kind, run_dir, n_steps=N_STEPS, act_every=10, upd_every=10, **options):
    model, opt = build(kind)
    modules = dict(model.named_modules())
    params = [p for _, p in model.named_parameters()]
    ref = {"loss": [], "grad_norm": [], "grad_absmax": [], "param_norm": [], "out_absmax": [],
           "acts": {}, "ratio": {}}
    state = {"step": 0, "outs": {}}

    def watch(name):
        def hook(module, args, out):
            o = out[0] if isinstance(out, tuple) else out
            assert name not in state["outs"], "watched modules are called once per step"
            state["outs"][name] = o.detach().to(torch.float64).clone()
        return hook

    test_handles = [modules[n].register_forward_hook(watch(n)) for n in WATCHED[kind]]
    t0 = time.time()
    rec = Recorder(model, run_dir, **options)
    try:
        for step in range(n_steps):
            state["step"], state["outs"] = step, {}
            x, y = batch(kind, step)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            before = [p.detach().clone() for p in params]
            opt.step()
            rec.step(loss=loss)
            with torch.no_grad():
                ref["loss"].append(float(loss.detach()))
                ref["grad_norm"].append([torch.linalg.vector_norm(p.grad).item() for p in params])
                ref["grad_absmax"].append([p.grad.abs().max().item() for p in params])
                ref["param_norm"].append([torch.linalg.vector_norm(p).item() for p in params])
                ref["out_absmax"].append([state["outs"][n].abs().max().item() for n in WATCHED[kind]])
                if step % act_every == 0:
                    for n, o in state["outs"].items():
                        ref["acts"][(step, n)] = (o.mean().item(), o.std().item(),
                                                  (o == 0).double().mean().item(), o.abs().max().item())
                if step % upd_every == 0:
                    ref["ratio"][step] = [
                        (torch.linalg.vector_norm(p.detach().double() - b.double())
                         / torch.linalg.vector_norm(b.double())).item()
                        for p, b in zip(params, before)
                    ]
    finally:
        rec.close()
        for h in test_handles:
            h.remove()
    return model, rec, ref, t0


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_round_trip(kind, tmp_path):
    model, rec, ref, t0 = _train_with_references(kind, tmp_path / "run")
    path = tmp_path / "run" / "rank0.h5"
    assert path.is_file()
    assert hooks_left(model) == 0, "close() must remove every hook it installed"

    pnames = [n for n, _ in model.named_parameters()]
    plist = [p for _, p in model.named_parameters()]
    mnames = [n for n, _ in model.named_modules()]

    with open_trace(path) as f:
        # -- run metadata --
        a = f.attrs
        assert attr_str(f, "format") == "torchautopsy-trace"
        assert int(a["schema_version"]) == 2
        assert attr_str(f, "torch_version") == torch.__version__
        assert attr_str(f, "host") == socket.gethostname()
        assert int(a["rank"]) == 0 and int(a["world_size"]) == 1
        start = dt.datetime.fromisoformat(attr_str(f, "start_time"))
        assert start.tzinfo is not None
        assert abs(start.timestamp() - t0) < 5
        cfg = json.loads(attr_str(f, "config"))
        assert cfg["activations_every"] == 10 and cfg["update_ratio_every"] == 10
        assert attr_str(f, "model_summary") == str(model)
        assert bool(a["closed"]) is True
        assert attr_str(f, "end_reason") == "closed"
        assert int(a["n_steps_recorded"]) == N_STEPS
        assert int(a["dropped_steps"]) == 0

        # -- static tables --
        assert names(f["params/name"]) == pnames
        assert [json.loads(s) for s in names(f["params/shape"])] == [list(p.shape) for p in plist]
        assert list(f["params/numel"][:]) == [p.numel() for p in plist]
        assert names(f["modules/name"]) == mnames
        assert names(f["modules/type"]) == [type(m).__name__ for _, m in model.named_modules()]
        assert [bool(v) for v in f["modules/is_leaf"][:]] == [
            len(list(m.children())) == 0 for _, m in model.named_modules()]

        # -- per-step tables --
        np.testing.assert_array_equal(f["steps/step"][:], np.arange(N_STEPS))
        loss = f["steps/loss"][:]
        assert loss.dtype == np.float64
        np.testing.assert_array_equal(loss, np.array(ref["loss"], dtype=np.float64))  # exact
        assert (f["steps/nonfinite_origin"][:] == -1).all()
        assert (f["steps/batch_nonfinite"][:] == 0).all()
        assert (f["steps/rss_bytes"][:] > 10 * 2**20).all()
        assert (f["steps/cuda_allocated_bytes"][:] == -1).all()
        assert (np.diff(f["steps/time_s"][:]) >= 0).all()

        assert f["params/grad_norm"].shape == (N_STEPS, len(pnames))
        np.testing.assert_allclose(f["params/grad_norm"][:], ref["grad_norm"], rtol=1e-5)
        # max |g|, module outputs: measured on the watched steps (0, 10); weight norms also on
        # the step before an update ratio (9). -1 elsewhere: not measured.
        watched, w_steps = [0, 10], [0, 9, 10]
        others = np.setdiff1d(np.arange(N_STEPS), watched)
        gmax = f["params/grad_absmax"][:]
        np.testing.assert_allclose(gmax[watched], np.array(ref["grad_absmax"])[watched], rtol=1e-6)
        assert (gmax[others] == -1).all()
        wn = f["params/param_norm"][:]
        np.testing.assert_allclose(wn[w_steps], np.array(ref["param_norm"])[w_steps], rtol=1e-5)
        assert (wn[np.setdiff1d(np.arange(N_STEPS), w_steps)] == -1).all()
        assert (f["params/grad_nonfinite"][:] == 0).all()

        widx = [mnames.index(n) for n in WATCHED[kind]]
        oabs = f["modules/output_absmax"][:]
        assert oabs.shape == (N_STEPS, len(mnames))
        np.testing.assert_allclose(oabs[watched][:, widx], np.array(ref["out_absmax"])[watched], rtol=1e-6)
        assert (oabs[others] == -1).all()
        oabs = oabs[watched]
        # -1 marks "not called this step": containers never called (ModuleList) and the
        # out_proj of MultiheadAttention (its weight is used functionally); all others ran.
        not_called = [i for i, (n, m) in enumerate(model.named_modules())
                      if isinstance(m, torch.nn.ModuleList) or n.endswith("self_attn.out_proj")]
        assert (oabs[:, not_called] == -1).all()
        called = np.setdiff1d(np.arange(len(mnames)), not_called)
        assert np.isfinite(oabs[:, called]).all() and (oabs[:, called] >= 0).all()

        # -- sampled activations: steps 0, 10 --
        np.testing.assert_array_equal(f["activations/step"][:], [0, 10])
        for row, step in enumerate([0, 10]):
            for n, i in zip(WATCHED[kind], widx):
                mean, std, zero_frac, absmax = ref["acts"][(step, n)]
                got = {k: float(f[f"activations/{k}"][row, i]) for k in ("mean", "std", "zero_frac", "absmax")}
                np.testing.assert_allclose(got["mean"], mean, rtol=1e-4, atol=1e-7, err_msg=f"{n} mean")
                np.testing.assert_allclose(got["std"], std, rtol=1e-4, err_msg=f"{n} std")
                np.testing.assert_allclose(got["zero_frac"], zero_frac, rtol=1e-4, err_msg=f"{n} zero_frac")
                np.testing.assert_allclose(got["absmax"], absmax, rtol=1e-6, err_msg=f"{n} absmax")
            assert (f["activations/nonfinite"][row, called] == 0).all()
            assert (f["activations/nonfinite"][row, not_called] == -1).all()  # -1: not called
            assert np.isnan(f["activations/mean"][row, not_called]).all()
            assert np.isfinite(f["activations/mean"][row, called]).all()
        if kind in ("mlp", "cnn"):  # a ReLU's zero share is real, not a default 0
            relu = mnames.index(WATCHED[kind][1] if kind == "mlp" else "2")
            assert 0.05 < f["activations/zero_frac"][0, relu] < 0.95

        # -- sampled update-to-weight ratios: steps 0, 10 --
        np.testing.assert_array_equal(f["updates/step"][:], [0, 10])
        ratio = f["updates/ratio"][:]
        assert ratio.shape == (2, len(pnames))
        np.testing.assert_allclose(ratio, [ref["ratio"][0], ref["ratio"][10]], rtol=1e-4)
        # (a conv bias followed by BatchNorm gets no gradient, so its ratio is a true 0)
        assert np.isfinite(ratio[1]).all() and (ratio[1] >= 0).all() and (ratio[1] > 0).mean() > 0.5


def test_custom_sampling_schedules(tmp_path):
    """activations_every / update_ratio_every are honoured, including the update ratio over
    exactly one step (weights copied after the step before the sampled one)."""
    model, rec, ref, _ = _train_with_references(
        "mlp", tmp_path / "run", n_steps=10, act_every=4, upd_every=3,
        activations_every=4, update_ratio_every=3)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        np.testing.assert_array_equal(f["activations/step"][:], [0, 4, 8])
        np.testing.assert_array_equal(f["updates/step"][:], [0, 3, 6, 9])
        np.testing.assert_allclose(f["updates/ratio"][:], [ref["ratio"][s] for s in (0, 3, 6, 9)], rtol=1e-4)
        mnames = names(f["modules/name"])
        i = mnames.index("0")
        np.testing.assert_allclose(f["activations/mean"][:, i], [ref["acts"][(s, "0")][0] for s in (0, 4, 8)],
                                   rtol=1e-4, atol=1e-7)
        assert json.loads(attr_str(f, "config"))["activations_every"] == 4


def test_update_ratio_every_step(tmp_path):
    """update_ratio_every=1: every step is both a sample and the step before the next one."""
    model, rec, ref, _ = _train_with_references("mlp", tmp_path / "run", n_steps=12, upd_every=1,
                                                update_ratio_every=1)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        np.testing.assert_array_equal(f["updates/step"][:], np.arange(12))
        np.testing.assert_allclose(f["updates/ratio"][:], [ref["ratio"][s] for s in range(12)], rtol=1e-4)


def test_update_ratio_budget_spacing(tmp_path):
    """Past the warm-up, update ratios are spaced by their measured cost: multiples of
    update_ratio_every, at most 10x it (how far depends on timing, so only the bounds are
    asserted here; the arithmetic below), each ratio still over exactly one step."""
    model, rec, ref, _ = _train_with_references(
        "mlp", tmp_path / "run", n_steps=120, upd_every=1,
        update_ratio_every=3, watch_warmup=21, update_ratio_budget=1e-9)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        steps = f["updates/step"][:]
        ratio = f["updates/ratio"][:]
    np.testing.assert_array_equal(steps[:8], np.arange(0, 22, 3))  # every 3rd in the warm-up
    gaps = np.diff(steps[7:])
    assert len(gaps) and (gaps % 3 == 0).all() and (gaps >= 3).all() and (gaps <= 30).all(), steps
    np.testing.assert_allclose(ratio, [ref["ratio"][s] for s in steps], rtol=1e-4)
    # The gap: the multiple of the base at which the sample's cost fits the budget, within bounds.
    assert StepPlanner.gap(1.0, 0.1, 3, 30) == 12  # 1.0 s a sample, 0.1 s a step allowed: 10 -> 12
    assert StepPlanner.gap(5.0, 0.1, 3, 30) == 30  # at most 10x
    assert StepPlanner.gap(-0.2, 0.1, 3, 30) == 3  # a sample that measured faster than a plain step


def test_histogram_budget_spacing(tmp_path):
    """Histograms every histogram_every-th step in the warm-up, then spaced by their measured
    cost: multiples of histogram_every, at most 10x it; each still counts every element of each
    weight and gradient it covers."""
    model, opt = build("mlp")
    n_steps = 120
    with Recorder(model, tmp_path / "run", histogram_every=3, watch_warmup=21, histogram_budget=1e-9) as rec:
        for step in range(n_steps):
            x, y = batch("mlp", step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            rec.step()
    numel = [p.numel() for p in model.parameters()]
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        steps = f["histograms/step"][:]
        params = f["histogram_params/param"][:]
        weight = f["histograms/weight"][:].reshape(len(steps), len(params), -1)
        grad = f["histograms/grad"][:].reshape(len(steps), len(params), -1)
    np.testing.assert_array_equal(steps[:8], np.arange(0, 22, 3))  # every 3rd in the warm-up
    gaps = np.diff(steps[7:])
    assert len(gaps) and (gaps % 3 == 0).all() and (gaps >= 3).all() and (gaps <= 30).all(), steps
    assert steps[-1] >= n_steps - 31, steps  # and they go on to the end
    expect = np.array([min(numel[i], 262144) for i in params])
    for counts in (weight, grad):
        np.testing.assert_array_equal(counts.sum(axis=2), np.broadcast_to(expect, counts.shape[:2]))


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.exists("/proc/self/statm"), reason="Linux fork")
def test_rss_in_a_forked_child_is_the_childs_own():
    """rss_bytes() keeps /proc/<pid>/statm open; a forked child (a DataLoader worker, a job
    forked after the recorder started) must read its own, not the parent's it inherited."""
    from torchautopsy.recorder.memory.readings import rss_bytes
    parent = rss_bytes()  # opens the parent's statm
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: grow by ~256 MiB of touched pages, report both readings
        try:
            os.close(r)
            block = b"x" * (256 * 2**20)
            with open("/proc/self/statm") as f:
                own = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            os.write(w, f"{rss_bytes()} {own} {len(block)}".encode())
        finally:
            os._exit(0)
    os.close(w)
    got, own, _ = map(int, os.read(r, 200).split())
    os.close(r)
    os.waitpid(pid, 0)
    assert got >= 256 * 2**20 and abs(got - own) < 32 * 2**20, (got, own, parent)
    assert abs(rss_bytes() - parent) < 128 * 2**20  # the parent still reads its own


def test_census_counts_tensor_subclasses(tmp_path):
    """The census filters the garbage collector's objects by type in C: it counts what a plain
    Python loop over them counts, parameters and users' own tensor subclasses included."""
    import gc

    from torchautopsy.recorder.memory.readings import tensor_census

    class Tagged(torch.Tensor):
        pass

    # The census keeps its largest groups only: what earlier tests of this worker process left
    # alive (compiled graphs' tensors) must not crowd this test's small group out of it.
    torch._dynamo.reset()
    gc.collect()
    shape = (7, 11, 13, 97)  # a shape no other tensor of the test process has (400 KB: a large group)
    keep = [torch.nn.Parameter(torch.zeros(shape)), torch.zeros(shape).as_subclass(Tagged)]
    keep.append(keep[1].view(shape))  # a view: counted, its storage not twice
    n, _, _, groups = tensor_census()
    objs = gc.get_objects()
    # (but the compiler's FakeTensors, which an earlier test's compiled graph may keep alive)
    ref = [o for o in objs if issubclass(type(o), torch.Tensor)
           and not type(o).__module__.startswith("torch._subclasses")]
    mine = [o for o in ref if tuple(o.shape) == shape]
    del objs
    assert {type(o) for o in mine} >= {torch.nn.Parameter, Tagged}
    assert n == len(ref)
    group = [g for g in groups if g["shape"] == "[7, 11, 13, 97]" and g["dtype"] == "float32"]
    assert sum(g["count"] for g in group) == len(mine) >= 3
    del keep, ref, mine
    assert tensor_census()[0] <= n - 3


class _Affine(torch.nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x):
        return x * self.std + self.mean


@pytest.mark.parametrize("mean,std", [(10.0, 0.01), (1000.0, 1.0)])
def test_activation_std_is_accurate_when_the_mean_dominates(tmp_path, mean, std):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), _Affine(mean, std))
    outs = []
    model[2].register_forward_hook(lambda m, a, o: outs.append(o.detach().double()))
    with Recorder(model, tmp_path / "run") as rec:
        model(torch.randn(256, 64)).sum().backward()
        rec.step()
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        i = names(f["modules/name"]).index("2")
        np.testing.assert_allclose(f["activations/mean"][0, i], outs[0].mean().item(), rtol=1e-5)
        np.testing.assert_allclose(f["activations/std"][0, i], outs[0].std().item(), rtol=1e-3)



class _Twice(torch.nn.Module):
    """One Linear called twice a forward, its two outputs of different means; a ReLU once."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        torch.nn.init.uniform_(self.lin.weight, 0.0, 0.2)  # the second call's mean: ~10
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.lin(self.act(self.lin(x)) * 5.0 + 3.0)


def test_activation_stats_of_a_module_called_twice_cover_both_calls(tmp_path):
    """A module called several times in a step (weight tying, a shared block) gets the mean,
    std and zero share of all its outputs together, combined exactly from each call's sums."""
    torch.manual_seed(0)
    model = _Twice()
    outs = {"lin": [], "act": []}
    for n in outs:
        getattr(model, n).register_forward_hook(lambda m, a, o, n=n: outs[n].append(o.detach().double()))
    with Recorder(model, tmp_path / "run") as rec:
        model(torch.randn(64, 32)).sum().backward()
        rec.step()
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        mnames = names(f["modules/name"])
        for n, calls in outs.items():
            i = mnames.index(n)
            both = torch.cat([o.reshape(-1) for o in calls])
            assert len(calls) == (2 if n == "lin" else 1)
            np.testing.assert_allclose(f["activations/mean"][0, i], both.mean().item(), rtol=1e-5, err_msg=n)
            np.testing.assert_allclose(f["activations/std"][0, i], both.std().item(), rtol=1e-5, err_msg=n)
            np.testing.assert_allclose(f["activations/zero_frac"][0, i], (both == 0).double().mean().item(),
                                       rtol=1e-6, err_msg=n)
        assert np.isfinite(f["activations/mean"][0, mnames.index("")])  # the root: the second call's output

@pytest.mark.parametrize("frozen_in_optimizer", [False, True])
def test_plain_steps_of_a_partly_frozen_model_record_the_same_norms(tmp_path, frozen_in_optimizer):
    """Most steps take the recorder's short path (norms from the optimizer pre-hook); a frozen
    layer (no gradient) must not push them off it or change what is written: NaN for it. Also
    when the optimizer holds the frozen parameters too (their None gradients skipped there)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad or frozen_in_optimizer],
                          lr=0.1, momentum=0.9)
    ref = []

    def norms(step, loss):
        ref.append([torch.linalg.vector_norm(p.grad).item() if p.grad is not None else np.nan
                    for p in model.parameters()])

    train(model, tmp_path / "run", 8, lambda step: batch("mlp", step), F.cross_entropy, optimizer=opt,
          after_update=norms)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        np.testing.assert_allclose(f["params/grad_norm"][:], ref, rtol=1e-5)
        assert np.isnan(f["params/grad_norm"][:, :2]).all()
        assert (f["params/param_norm"][2:8] == -1).all()  # not measured on plain steps


def test_norms_from_the_optimizer_hook_only_while_they_still_hold(tmp_path):
    """The norms the optimizer step pre-hook computed are written only for the gradients it saw,
    as they still are at rec.step(): two optimizers of two halves of the model add up; a
    gradient scaled in place or replaced after the update, or a parameter no optimizer steps, is
    measured again at rec.step()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3),
                                torch.nn.Linear(3, 3))
    params = list(model.parameters())
    opt_a = torch.optim.SGD(params[:2], lr=0.1)
    opt_b = torch.optim.SGD(params[2:4], lr=0.1)  # model[3] is in neither
    ref = []
    with Recorder(model, tmp_path / "run") as rec:
        for step in range(12):
            x, y = batch("mlp", step)
            loss = F.cross_entropy(model(x), y)
            opt_a.zero_grad()
            opt_b.zero_grad()
            model[3].zero_grad()
            loss.backward()
            if step % 2 == 0:  # even steps: model[3] has no gradient (NaN), odd ones have one
                for p in model[3].parameters():
                    p.grad = None
            opt_a.step()
            if step % 3 != 1:  # steps 1, 4, 7, 10: only opt_a
                opt_b.step()
            if step % 4 == 2:  # steps 2, 6, 10: a gradient changed after the update
                params[0].grad.mul_(3.0)
            if step in (4, 8):  # and one replaced
                params[2].grad = params[2].grad * 2.0
            ref.append([torch.linalg.vector_norm(p.grad).item() if p.grad is not None else np.nan
                        for p in params])
            rec.step(loss=loss)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        np.testing.assert_allclose(f["params/grad_norm"][:], ref, rtol=1e-5)
