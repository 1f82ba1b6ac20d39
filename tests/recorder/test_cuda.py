"""The recorder on a GPU: CUDA memory counters, CUDA profiler activity, NaN origin on device.

Skipped without CUDA (this project's CI has no GPU); run on a machine with one to check the
CUDA paths. The rest of the suite covers the same code on the CPU.
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from torchautopsy import Recorder, load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class NaNAt(nn.Module):
    """Multiplies by NaN at one step. Its call counter is a buffer, on the GPU with the model:
    state that the black box's replay of the step starts from, so the replay reproduces it."""

    def __init__(self, step):
        super().__init__()
        self.step = step
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x * math.nan if int(self.calls) == self.step + 1 else x


def test_recorder_on_cuda(tmp_path):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), NaNAt(25), nn.Linear(256, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(model, tmp_path, profile_first=5) as rec:
        for _ in range(30):
            loss = model(torch.randn(128, 64, device=dev)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    rt = load(tmp_path).ranks[0]
    steps = rt.steps
    assert rt.meta["device"].startswith("cuda")
    assert (steps["cuda_allocated_bytes"] > 0).all() and (steps["cuda_reserved_bytes"] > 0).all()
    assert (steps["cuda_peak_bytes"] >= steps["cuda_allocated_bytes"]).all()
    # Step 25 was not watched: the black box replayed its forward on a copy of the model, on the
    # GPU, from the buffers and CUDA RNG state the step started from, and found the module.
    origin = steps["nonfinite_origin"].to_numpy()
    assert (origin[:25] == -1).all() and origin[25] >= 0 and rt.module_names[origin[25]] == "2"
    assert rt.blackbox["detail"].iloc[0]["trigger_detail"]["origin_replay"] == "reproduced: module '2'"
    ops = rt.profile_ops(0)
    assert (ops["device_self_us"] > 0).any()  # CUDA kernels were profiled
    g = rt.param_stat("grad_norm").to_numpy()
    assert np.isfinite(g[:25]).all()


def test_copies_back_and_forth_are_flagged_on_cuda(tmp_path):
    # The loop copies its activations to the host and back every step (a debugging leftover).
    from torchautopsy.analyzer.run import analyze

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x_host = torch.randn(4096, 512)
    with Recorder(model, tmp_path, profile_first=5) as rec:
        for _ in range(12):
            x = x_host.to(dev)  # pageable memory, every step
            out = model(x)
            out.detach().cpu()
            x.cpu()
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    found = [f for f in analyze(load(tmp_path)) if f.kind == "host_device_copies"]
    assert found and found[0].evidence["share"] >= 0.2, [f.summary for f in found]


# -- the CUDA allocator's snapshots, history and out-of-memory events ---------------------------

def _train(model, rec, steps, dev, hook=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(steps):
        if hook is not None:
            hook(step)
        loss = model(torch.randn(256, 64, device=dev)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(loss=loss)


def test_snapshots_are_recorded_as_tables_and_export_to_the_memory_viewer(tmp_path):
    import pickle

    from torch.cuda import _memory_viz

    from tests.helpers import run_cli
    from torchautopsy.analyzer.memory_snapshot import live_sites, snapshot_dict

    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1)).to(dev)
    with Recorder(model, tmp_path, cuda_snapshot_first=2, cuda_snapshot_every=5, profile_steps=0) as rec:
        assert rec.memory.cuda is not None and rec.memory.cuda.started_history
        _train(model, rec, 12, dev)
    after = torch.cuda.memory._snapshot()  # the recorder stopped the history it started
    assert not any(after.get("device_traces") or [])
    rt = load(tmp_path).ranks[0]
    snaps = rt.memory_snapshots
    assert {2, 7} <= set(int(s) for s in snaps["step"])
    n = int(snaps[snaps["step"] == 7]["snapshot"].iloc[0])
    assert len(rt.memory_snapshot_rows(n)["trace"]) > 0  # the history came with it
    assert any("test_cuda.py" in g["site"] for g in live_sites(rt, n))  # where this test allocated
    out = tmp_path / "s.pickle"
    r = run_cli("export", tmp_path, "--memory-snapshot", out, "--which", str(n))
    assert r.returncode == 0, r.stderr
    with open(out, "rb") as f:
        back = pickle.load(f)
    assert back == snapshot_dict(rt, n)
    assert "total_reserved" in _memory_viz.segsum(back) and _memory_viz.trace(back)
    assert "<" in _memory_viz.trace_plot(back)


def test_a_real_snapshot_round_trips_exactly(tmp_path):
    import copy
    import pickle

    from tests.helpers import run_cli
    from torchautopsy.recorder.memory.cuda_allocator import SnapshotConverter

    dev = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        kept = [torch.randn(1024, 1024, device=dev) for _ in range(3)]
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    model = nn.Linear(4, 1)
    with Recorder(model, tmp_path, profile_steps=0) as rec:
        rec.writer.put(SnapshotConverter().rows(copy.deepcopy(snap), 0, 0, "schedule", 0.0, 0, 0, 0))
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    out = tmp_path / "s.pickle"
    assert run_cli("export", tmp_path, "--memory-snapshot", out).returncode == 0
    with open(out, "rb") as f:
        assert pickle.load(f) == snap
    del kept


def test_a_history_the_job_started_is_kept(tmp_path):
    dev = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=5000)
    try:
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
        with Recorder(model, tmp_path, profile_steps=0) as rec:
            assert rec.memory.cuda.user_history and not rec.memory.cuda.started_history
            _train(model, rec, 3, dev)
        x = torch.ones(1000, device=dev)  # still recorded after the recorder closed
        assert any(e.get("action") == "alloc" for e in torch.cuda.memory._snapshot()["device_traces"][dev.index or 0])
        del x
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_running_out_of_cuda_memory_is_caught_and_analyzed(tmp_path):
    import pickle

    from torch.cuda import _memory_viz

    from tests.helpers import run_cli
    from torchautopsy.analyzer.run import analyze

    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    hoard = []

    def hog(step):
        if step == 5:  # a cache that grows until the device is full
            while True:
                hoard.append(torch.empty(2**30, dtype=torch.uint8, device=dev))

    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            with Recorder(model, tmp_path, profile_steps=0) as rec:
                _train(model, rec, 10, dev, hook=hog)
    finally:
        n_hoarded = len(hoard)
        hoard.clear()
        torch.cuda.empty_cache()
    rt = load(tmp_path).ranks[0]
    events = rt.oom_events
    assert set(events["source"]) == {"observer", "exception"} and (events["step"] == 5).all()
    (f,) = [f for f in analyze(load(tmp_path)) if f.kind == "out_of_memory"]
    ev = f.evidence
    assert f.severity == "error" and f.step == 5 and ev["requested_bytes"] == 2**30
    assert ev["device_allocated_bytes"] >= (n_hoarded - 1) * 2**30
    assert "in hog" in ev["largest_sites"][0]["site"] and ev["largest_sites"][0]["blocks"] >= n_hoarded - 1
    assert "in hog" in ev["failed_request"]["site"]
    out = tmp_path / "oom.pickle"
    r = run_cli("export", tmp_path, "--memory-snapshot", out, "--which", "oom")
    assert r.returncode == 0, r.stderr
    with open(out, "rb") as fh:
        assert "OutOfMemoryError" in _memory_viz.trace(pickle.load(fh))


def test_a_cuda_leak_names_the_allocation_site_that_grew(tmp_path):
    from torchautopsy.analyzer.run import analyze

    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    kept = []

    def keep_outputs(step):  # a debugging list of 4 MiB device buffers, one per step, never cleared
        kept.append(torch.zeros(2**20, device=dev))

    with Recorder(model, tmp_path, cuda_snapshot_first=5, cuda_snapshot_every=30, profile_steps=0) as rec:
        _train(model, rec, 100, dev, hook=keep_outputs)
    (f,) = [f for f in analyze(load(tmp_path)) if f.kind == "memory_leak"]
    assert f.evidence["series"] == "cuda_allocated_bytes"
    site = f.evidence["growing_sites"][0]
    assert "in keep_outputs" in site["site"] and site["bytes_after"] - site["bytes_before"] >= 60 * 2**22
    assert "in keep_outputs" in f.summary
    kept.clear()
    torch.cuda.empty_cache()


def _syncs_per_step(model, rec, steps, dev):
    """Host synchronisations per training step, as CUDA's sync debug mode reports them."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256, device=dev), torch.randint(0, 10, (64,), device=dev)
    counts = []
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.step(loss=loss)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return counts


@pytest.mark.parametrize("deterministic", [False, True])
def test_host_syncs_per_step(tmp_path, deterministic):
    """Two on a plain step: the gradient norms before the optimizer's update (the black box needs
    them then) and the loss. Watched, histogram and update-ratio steps carry their reductions in
    the loss's transfer (2 on an H100 too); the first step sets up. Also under torch's
    deterministic mode, whose ops must not stop the recording."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10)).to(dev)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        with Recorder(model, tmp_path, profile_steps=0, cuda_snapshot_first=0, cuda_snapshot_every=0) as rec:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # a recorder error would stop it
                counts = _syncs_per_step(model, rec, 120, dev)
    finally:
        torch.use_deterministic_algorithms(was)
    later = counts[1:]
    assert sorted(later)[len(later) // 2] == 2, counts  # the plain steps
    assert max(later) <= 4, counts  # watched steps, the histograms at step 100 included
    rt = load(tmp_path).ranks[0]
    assert rt.meta["end_reason"] == "closed" and len(rt.steps) == 120
    assert {0, 100} <= set(rt.histogram_steps.tolist())
    _, _, counts = rt.histograms("grad")
    assert (counts.sum(axis=2) > 0).all()  # every gradient histogrammed, on the device
