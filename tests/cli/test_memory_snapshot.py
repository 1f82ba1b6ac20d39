"""CUDA memory snapshots: stored as tables (no pickle in the trace), exported as the pickle that
PyTorch's memory viewer reads, analysed for what held the memory.

Without a GPU, the snapshots come from two sources, fed through the recorder's real conversion
and writer: a dict written here in exactly the structure ``torch.cuda.memory._snapshot()``
documents (torch/cuda/memory.py) and torch/csrc/cuda/Module.cpp fills in, and a snapshot that
torch itself builds on the CPU (``torch.cuda._memory_viz._profile_to_snapshot`` from a memory
profile). The exported pickle must equal the input and be accepted by torch's own
``_memory_viz`` functions. tests/recorder/test_cuda.py checks real ``_snapshot()`` output on a GPU.
"""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.cuda import _memory_viz

from torchautopsy import Recorder, load
from torchautopsy.analyzer.memory_snapshot import history_peak, live_sites, oom_request, snapshot_dict
from tests.cli.test_bad_input import assert_one_line_error
from tests.helpers import invoke_cli
from tests.training import train

MiB = 2**20
TRAIN = "/home/user/train.py"
TORCH = "/usr/lib/python3/site-packages/torch/nn/modules/linear.py"


def frames(*where):
    """Frames innermost first, as the allocator records them."""
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


def documented_snapshot() -> dict:
    """A small snapshot in the documented structure: one large segment holding a 40 MiB
    activation (allocated in train.py:forward) and the weights, one small segment, and a history
    that allocates and frees a 60 MiB temporary before running out of memory."""
    act_stack = frames((TORCH, 125, "forward"), (TRAIN, 31, "forward"), (TRAIN, 80, "main"))
    w_stack = frames((TRAIN, 12, "__init__"), (TRAIN, 70, "main"))
    tmp_stack = frames((TRAIN, 40, "loss_fn"), (TRAIN, 82, "main"))
    base = 0x7F0000000000
    seg0 = {
        "device": 0, "address": base, "total_size": 128 * MiB, "allocated_size": 48 * MiB,
        "active_size": 48 * MiB, "requested_size": 48 * MiB - 100, "stream": 0, "segment_type": "large",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": act_stack,
        "blocks": [
            {"address": base, "size": 40 * MiB, "requested_size": 40 * MiB - 100, "state": "active_allocated",
             "frames": act_stack},
            {"address": base + 40 * MiB, "size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated",
             "frames": w_stack},
            {"address": base + 48 * MiB, "size": 80 * MiB, "requested_size": 0, "state": "inactive", "frames": []},
        ],
    }
    seg1 = {
        "device": 0, "address": base + 512 * MiB, "total_size": 2 * MiB, "allocated_size": 512,
        "active_size": 512, "requested_size": 500, "stream": 0, "segment_type": "small",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
        "blocks": [
            {"address": base + 512 * MiB, "size": 512, "requested_size": 500, "state": "active_allocated",
             "frames": w_stack},
            {"address": base + 512 * MiB + 512, "size": 2 * MiB - 512, "requested_size": 0, "state": "inactive",
             "frames": []},
        ],
    }

    def entry(action, addr, size, t, stack=None, **kw):
        e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
             "compile_context": "", "user_metadata": ""}
        if stack is not None:
            e["frames"] = stack
        e.update(kw)
        return e

    trace = [
        entry("segment_alloc", base, 128 * MiB, 1000, act_stack),
        entry("alloc", base + 40 * MiB, 8 * MiB, 1001, w_stack),
        entry("alloc", base, 40 * MiB, 1002, act_stack),
        entry("alloc", base + 48 * MiB, 60 * MiB, 1003, tmp_stack),
        entry("free_requested", base + 48 * MiB, 60 * MiB, 1004),
        entry("free_completed", base + 48 * MiB, 60 * MiB, 1005),
    ]
    oom = {"action": "oom", "device_free": 3 * MiB, "size": 200 * MiB, "stream": 0, "time_us": 1006,
           "frames": tmp_stack, "compile_context": "", "user_metadata": ""}
    return {
        "segments": [seg0, seg1],
        "device_traces": [trace + [oom]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                               "garbage_collection_threshold": 0.0, "expandable_segments": False,
                               "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
                               "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {"1": 0}},
    }


def newer_snapshot() -> dict:
    """The documented snapshot with what torch 2.11 adds on an H100 (seen there): a top-level
    "external_annotations" list, and C++ frames (a history that records "all" stacks) whose
    template names run past 512 characters."""
    snap = documented_snapshot()
    snap["external_annotations"] = [{"time_us": 1000, "stage": "START", "name": "optimizer"}]
    cpp = "c10::impl::wrap_kernel_functor_unboxed_<" + "c10::ArrayRef<c10::SymInt>, " * 40 + ">::call"
    assert len(cpp) > 1000
    snap["device_traces"][0][0]["frames"].append({"filename": "??", "line": 0, "name": cpp})
    return snap


def profiled_snapshot() -> dict:
    """A snapshot torch builds itself on the CPU, from a memory profile (older key set, extra
    "category" keys, no addresses on blocks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
    return _memory_viz._profile_to_snapshot(prof)


def record_with(run_dir, snapshots, oom_at=None):
    """A real CPU run whose trace gets the given snapshots through the recorder's conversion and
    writer (what the CUDA path does with torch.cuda.memory._snapshot()'s result)."""
    from torchautopsy.recorder.memory.cuda_allocator import SnapshotConverter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    conv = SnapshotConverter()
    with Recorder(model, run_dir, profile_steps=0) as rec:
        for step in range(6):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
            if step < len(snapshots):
                snap, reason = snapshots[step]
                rec.writer.put(conv.rows(copy.deepcopy(snap), step, step, reason, 0.0, 0, 48 * MiB, 130 * MiB))
            if step == oom_at:  # the row the CUDA allocator's out-of-memory observer writes
                rec.writer.put({"oom_events": {
                    "step": step, "time_s": 0.0, "source": "observer", "device": "cuda:0",
                    "requested_bytes": 200 * MiB, "device_allocated_bytes": 48 * MiB + 512,
                    "device_reserved_bytes": 130 * MiB, "device_free_bytes": 3 * MiB,
                    "device_total_bytes": 133 * MiB, "rss_bytes": 10**9, "snapshot": step, "message": "",
                    "raised_at": ""}})


@pytest.mark.parametrize("make", [documented_snapshot, newer_snapshot, profiled_snapshot])
def test_export_gives_back_the_snapshot_and_torch_memory_viz_reads_it(tmp_path, make):
    snap = make()
    record_with(tmp_path / "run", [(snap, "schedule"), (snap, "oom")])
    out = tmp_path / "snap.pickle"
    r = invoke_cli("export", tmp_path / "run", "--memory-snapshot", out, "--which", "0", block_torch=True)
    assert r.returncode == 0, r.stderr  # (the analyzer needs no torch to write it)
    assert "CUDA memory snapshot 0 of rank 0 (schedule, step 0" in r.stdout
    with open(out, "rb") as f:
        back = pickle.load(f)
    assert back == snap
    # torch's own viewer code accepts it: the text summaries and the HTML viewers
    assert "total_reserved" in _memory_viz.segsum(back)
    assert "<" in _memory_viz.segment_plot(back) and "<" in _memory_viz.trace_plot(back)
    assert _memory_viz.memory(back, format_flamegraph=lambda lines: lines).strip()
    if make is documented_snapshot:
        text = _memory_viz.trace(back)  # replays the history against the segments
        assert "cudaMalloc" in text and "raise OutOfMemoryError # 200.0MiB requested, 3.0MiB free" in text
    assert "CUDA memory  2 allocator snapshot(s) at steps 0, 1" in invoke_cli("info", tmp_path / "run").stdout
    # the default export is the snapshot taken when memory ran out
    r = invoke_cli("export", tmp_path / "run", "--memory-snapshot", out, "--force")
    assert r.returncode == 0 and "(oom, step 1" in r.stdout, r.stdout + r.stderr


def test_what_held_the_memory(tmp_path):
    record_with(tmp_path / "run", [(documented_snapshot(), "oom")])
    rt = load(tmp_path / "run").ranks[0]
    assert snapshot_dict(rt, 0) == documented_snapshot()
    sites = live_sites(rt, 0)
    assert sites[0]["site"] == f"{TRAIN}:31 in forward" and sites[0]["bytes"] == 40 * MiB
    assert sites[1]["site"] == f"{TRAIN}:12 in __init__" and sites[1]["blocks"] == 2
    peak = history_peak(rt, 0)  # the 60 MiB temporary was live at the peak of the history
    assert peak["bytes"] == 108 * MiB + 512
    assert peak["sites"][0]["site"] == f"{TRAIN}:40 in loss_fn" and peak["sites"][0]["bytes"] == 60 * MiB
    req = oom_request(rt, 0)
    assert req == {"bytes": 200 * MiB, "device_free": 3 * MiB, "site": f"{TRAIN}:40 in loss_fn",
                   "stack": [f"{TRAIN}:40 in loss_fn", f"{TRAIN}:82 in main"]}


def test_export_without_snapshots_or_with_a_wrong_one_is_a_one_line_error(tmp_path):
    record_with(tmp_path / "cpu", [])
    assert_one_line_error(invoke_cli("export", tmp_path / "cpu", "--memory-snapshot", tmp_path / "s.pickle"),
                          "holds no CUDA memory snapshots")
    record_with(tmp_path / "run", [(documented_snapshot(), "schedule")])
    for which, needle in (("7", "no memory snapshot 7"), ("oom", "no snapshot taken when memory ran out"),
                          ("bogus", "give a number, last, peak or oom")):
        r = invoke_cli("export", tmp_path / "run", "--memory-snapshot", tmp_path / "s.pickle", "--which", which)
        assert_one_line_error(r, needle)
    assert not (tmp_path / "s.pickle").exists()


def test_a_cuda_oom_names_the_request_the_holders_and_the_site_that_asked(tmp_path):
    record_with(tmp_path / "run", [(documented_snapshot(), "schedule"), (documented_snapshot(), "oom")], oom_at=1)
    out = tmp_path / "f.json"
    r = invoke_cli("analyze", tmp_path / "run", "--json", out, "--md", tmp_path / "r.md", "--html", tmp_path / "r.html")
    assert r.returncode == 0, r.stderr
    import json

    (f,) = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "out_of_memory"]
    assert f["severity"] == "error" and f["step"] == 1
    ev = f["evidence"]
    assert ev["requested_bytes"] == 200 * MiB and ev["device_free_bytes"] == 3 * MiB and ev["snapshot"] == 1
    assert ev["largest_sites"][0]["site"] == f"{TRAIN}:31 in forward"
    assert ev["failed_request"]["site"] == f"{TRAIN}:40 in loss_fn"
    assert ("a request for 200.0 MiB failed with 48.0 MiB allocated by tensors, 130.0 MiB reserved by "
            "PyTorch's allocator and 3.0 MiB free on the device (of 133.0 MiB)") in f["summary"]
    assert f"The request came from {TRAIN}:40 in loss_fn" in f["summary"]
    # 82 MiB reserved but free could not have served 200 MiB: no fragmentation advice
    assert "expandable_segments" not in f["advice"] and "memory_viz" in f["advice"]
    html = (tmp_path / "r.html").read_text()
    assert "out_of_memory" in html and "train.py:31 in forward" in html
    # the appendix: the peak of the history (the 60 MiB temporary of loss_fn was live then)
    assert "CUDA memory at its peak, by allocation site" in html and "train.py:40 in loss_fn" in html


def test_the_allocation_site_that_grew_between_snapshots(tmp_path):
    from torchautopsy.analyzer.memory_snapshot import site_growth

    before, after = documented_snapshot(), documented_snapshot()
    seg = after["segments"][0]
    kept = frames((TRAIN, 55, "log_outputs"), (TRAIN, 84, "main"))
    free = seg["blocks"].pop()  # 80 MiB inactive: 30 MiB of it now held by a list of outputs
    seg["blocks"] += [
        {"address": free["address"], "size": 30 * MiB, "requested_size": 30 * MiB, "state": "active_allocated",
         "frames": kept},
        {"address": free["address"] + 30 * MiB, "size": 50 * MiB, "requested_size": 0, "state": "inactive",
         "frames": []},
    ]
    record_with(tmp_path / "run", [(before, "schedule"), (after, "peak")])
    rt = load(tmp_path / "run").ranks[0]
    assert snapshot_dict(rt, 1) == after
    (g,) = site_growth(rt, 0, 1)
    assert g["site"] == f"{TRAIN}:55 in log_outputs" and (g["bytes_before"], g["bytes_after"]) == (0, 30 * MiB)


class Hungry(nn.Module):
    """A layer whose forward at one step asks for far more memory than any machine has."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at + 1:
            x = x.new_empty(2**52)  # 16 PiB: the CPU allocator refuses it
        return self.lin(x)


def test_a_cpu_out_of_memory_error_leaving_the_recorder_is_an_error_finding(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Hungry(12), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept = []
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        # 2 MiB a step, kept: the largest group
        train(model, tmp_path / "run", 30, lambda step: torch.randn(8, 16), optimizer=opt, profile_steps=0,
              before_step=lambda step: kept.append(torch.zeros(512, 1024)))
    out = tmp_path / "f.json"
    r = invoke_cli("analyze", tmp_path / "run", "--json", out, "--fail-on", "error")
    assert r.returncode == 1, r.stderr
    import json

    (f,) = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "out_of_memory"]
    ev = f["evidence"]
    assert f["step"] == 12 and ev["device"] == "cpu" and ev["requested_bytes"] == 2**52 * 4
    assert ev["largest_tensor_groups"][0] == {"device": "cpu", "dtype": "float32", "shape": "[512, 1024]",
                                              "graph": False, "count": 13, "bytes": 13 * 2 * MiB}
    assert "test_memory_snapshot.py" in ev["raised_at"][-1] and "in forward" in ev["raised_at"][-1]
    assert f["summary"].startswith("Out of memory at step 12 on cpu: a request for 16.0 PiB failed")
    assert "in forward." in f["summary"] and "test_memory_snapshot.py" in f["summary"]
    assert "13 x [512, 1024] float32 on cpu (26.0 MiB)" in f["summary"]


def test_names_from_a_snapshot_are_escaped_in_reports(tmp_path):
    snap = documented_snapshot()
    evil = frames(("<script>alert(1)</script>.py", 1, "<b>forward</b>"))
    snap["segments"][0]["blocks"][0]["frames"] = evil
    snap["device_traces"][0][-1]["frames"] = evil
    record_with(tmp_path / "run", [(snap, "oom")], oom_at=0)
    r = invoke_cli("analyze", tmp_path / "run", "--html", tmp_path / "r.html", "--pdf", tmp_path / "r.pdf",
                "--md", tmp_path / "r.md")
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "r.html").read_text()
    assert "<script>alert(1)" not in html and "<b>forward" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;.py:1 in &lt;b&gt;forward&lt;/b&gt;" in html
    assert (tmp_path / "r.pdf").read_bytes().startswith(b"%PDF")


def test_an_out_of_memory_error_that_ends_a_job_without_a_with_block_is_caught_at_exit(jobs, tmp_path):
    """The job: a process forked from an interpreter that imported torch (tests/forked_jobs.py),
    dying of its uncaught error through the interpreter's real exit (the recorder's atexit hook)."""
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, torch
        from torch import nn
        from torchautopsy import Recorder
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        rec = Recorder(model, sys.argv[1], profile_steps=0)  # no `with`, no close(): the job dies
        for step in range(20):
            if step == 7:
                cache = torch.empty(2**50)  # 4 PiB
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            rec.step(loss=loss)
    """)
    r = jobs.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                 timeout=120)
    assert r.returncode == 1 and "can't allocate memory" in r.stderr
    rt = load(tmp_path / "run").ranks[0]
    (e,) = rt.oom_events.to_dict("records")
    assert (e["step"], e["source"], e["requested_bytes"]) == (7, "exception", 2**52)
    assert rt.meta["end_reason"].startswith("exception: RuntimeError")


def test_a_hundred_thousand_blocks_on_one_deep_stack_are_grouped_in_bounded_time(tmp_path):
    """Issue 38 (3): 100,000 snapshot blocks sharing one 20,000-frame stack ran past 60 s (each
    block's site was looked up through the whole stack): each stack is read once, and the job's
    own frame is looked for among its first 256 frames."""
    import shutil
    import time

    import h5py
    import numpy as np

    from tests.helpers import SAMPLES
    from tests.hostile.mutations import add_memory_snapshot, replace, texts

    shutil.copy(SAMPLES / "healthy_mlp" / "rank0.h5", tmp_path / "rank0.h5")
    n, depth = 100_000, 20_000
    with h5py.File(tmp_path / "rank0.h5", "r+") as f:
        add_memory_snapshot(f)
        cols = {"snapshot": np.zeros(n, np.int64), "segment": np.zeros(n, np.int64),
                "address": (1 << 40) + np.arange(n, dtype=np.int64) * 512, "size": np.full(n, 512, np.int64),
                "requested_size": np.full(n, 512, np.int64), "stack": np.zeros(n, np.int64),
                "keys": np.full(n, 0x1F, np.int64)}
        for col, values in cols.items():
            replace(f, f"memory_blocks/{col}", data=values.astype(f[f"memory_blocks/{col}"].dtype), maxshape=(None,))
        for col in ("state", "extra"):
            replace(f, f"memory_blocks/{col}", data=texts(["active_allocated" if col == "state" else ""] * n, (n,)),
                    dtype=h5py.string_dtype(), maxshape=(None,))
        replace(f, "memory_stack_frames/frame", data=np.ones(depth, f["memory_stack_frames/frame"].dtype), maxshape=(None,))
        f["memory_stacks/length"][0] = depth  # one stack of 20,000 library frames
    t0 = time.monotonic()
    (site,) = live_sites(load(tmp_path).ranks[0], 0)
    assert time.monotonic() - t0 < 20
    assert site["blocks"] == n and site["bytes"] == 512 * n and len(site["stack"]) == 6
    r = invoke_cli("analyze", tmp_path, "--md", tmp_path / "r.md")
    assert r.returncode == 0, r.stderr
