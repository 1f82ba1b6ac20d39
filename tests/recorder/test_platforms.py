"""`from torchautopsy import Recorder` needs no POSIX-only module, and resident memory is read
as it is now (not its peak) where the platform allows: /proc on Linux, here.

What can be checked on this Linux machine: the recorder imports and records with the POSIX-only
modules (resource, fcntl, pwd, grp, termios) unimportable, as on Windows (torch and the standard
library guard their own use of them); the reading is the current resident set, which falls
when memory is given back. The macOS (Mach task info) and Windows (GetProcessMemoryInfo)
readers in memory/readings.py cannot run here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from torchautopsy.recorder.memory import readings as memory

BLOCKED = ("resource", "fcntl", "pwd", "grp", "termios")

WITHOUT_POSIX_MODULES = textwrap.dedent("""
    import json, sys

    BLOCKED = set(sys.argv[2].split(","))

    class Unix:  # as on Windows: these modules do not exist
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Unix())
    import torch
    from torch import nn
    from torchautopsy import Recorder
    import h5py

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, sys.argv[1], profile_first=1, profile_steps=1, profile_every=2) as rec:
        for step in range(4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            rec.step(loss=loss)
    with h5py.File(rec.path, "r") as f:
        out = {"rss": f["steps/rss_bytes"][()].tolist(), "source": f.attrs["rss_source"],
               "end_reason": f.attrs.get("end_reason"), "profile_windows": int(f["profile_windows/window"].shape[0])}
    out["loaded"] = sorted(m for m in BLOCKED if m in sys.modules)
    print(json.dumps(out))
""")


@pytest.mark.slow  # a subprocess
def test_recorder_imports_and_records_without_posix_only_modules():
    root = tempfile.mkdtemp(prefix="prof_")
    try:
        r = subprocess.run([sys.executable, "-c", WITHOUT_POSIX_MODULES, os.path.join(root, "run"), ",".join(BLOCKED)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr == "", r.stderr[-3000:]  # no recorder warning: nothing failed
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["loaded"] == []
        assert out["end_reason"] == "closed"
        assert out["profile_windows"] == 2
        assert out["source"] == memory.RSS_SOURCE == "statm"  # Linux: /proc, which needs none of them
        assert len(out["rss"]) == 4 and all(v > 10 * 2**20 for v in out["rss"]), out["rss"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _status_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_rss_is_current_resident_memory_not_the_peak():
    assert memory.RSS_SOURCE == "statm"
    before = memory.rss_bytes()
    assert abs(before - _status_rss()) < 8 * 2**20  # what the kernel reports, give or take
    block = np.ones(256 * 2**20 // 8)  # 256 MiB, touched: resident
    during = memory.rss_bytes()
    del block  # a block this large is its own mapping: freeing it gives it back to the kernel
    after = memory.rss_bytes()
    assert during - before > 200 * 2**20, (before, during)
    assert during - after > 200 * 2**20, (during, after)  # falls again: not ru_maxrss's peak
    # getrusage's peak (the fallback off Linux) is in kilobytes here, converted to bytes.
    peak = memory._peak_reader()()
    assert peak >= during - 8 * 2**20
