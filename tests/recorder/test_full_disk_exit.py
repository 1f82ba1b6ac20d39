"""Issue 38 (1): the job's exit status is not the recorder's to change.

A real full disk (a 3 MB tmpfs): the job's own checkpoint fills it at step 20, the recorder warns
once and stops, training goes on. The recorder tried to close its file then: the close failed (it
must flush), and HDF5 crashed the process at interpreter exit (exit status 139 or 135 in every
run, after the script's last line). Now a file the disk cannot close is left open and never
finalized, and the job exits as the same job does without the recorder. Needs root to mount the
tmpfs (CI runs as root); skipped where it cannot. Each job a process forked from an interpreter
that imported torch (tests/forked_jobs.py): it imports the recorder itself and exits through the
interpreter's real exit (its exit handlers, finalization, the C library's exit), where the crash was."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tests.helpers import REPEAT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tmpfs")

JOB = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    rec = None
    if sys.argv[1] == "recorded":
        from torchautopsy import Recorder
        rec = Recorder(model, sys.argv[2] + "/run")
    for step in range(200):
        loss = F.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
        opt.zero_grad(); loss.backward(); opt.step()
        if rec is not None:
            rec.step(loss=loss)
        if step == 20:  # the job's own checkpoint fills the disk
            try:
                with open(sys.argv[2] + "/checkpoint.pt", "wb") as f:
                    while True:
                        f.write(bytes(65536))
            except OSError:
                pass
    if rec is not None:
        rec.close()
    print("done", flush=True)
""")


@pytest.fixture
def tiny_disk():
    where = tempfile.mkdtemp(prefix="tiny_disk_")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", where], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield where
    subprocess.run(["umount", where], capture_output=True)
    os.rmdir(where)


def _job(jobs, mode: str, disk: str) -> subprocess.CompletedProcess:
    subprocess.run(f"rm -rf {disk}/*", shell=True)
    return jobs.run([sys.executable, "-c", JOB, mode, disk], capture_output=True, text=True, timeout=120)


def test_a_job_whose_disk_fills_exits_as_it_does_without_the_recorder(jobs, tiny_disk):
    bare = _job(jobs, "bare", tiny_disk)
    assert bare.returncode == 0 and "done" in bare.stdout, bare.stderr
    codes = []
    for _ in range(REPEAT):
        r = _job(jobs, "recorded", tiny_disk)
        assert "done" in r.stdout and r.stderr.count("RuntimeWarning: torchautopsy:") == 1, r.stderr  # one warning
        codes.append(r.returncode)
    assert codes == [bare.returncode] * REPEAT, codes
