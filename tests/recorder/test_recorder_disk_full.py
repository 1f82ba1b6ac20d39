"""A full disk mid-run (DESIGN: "a recorder fault must never crash the training job (it warns
once and stops recording)", "everything written up to the last flush must read back").

The child process stands in for a full disk with RLIMIT_FSIZE (writes past it fail with EFBIG;
SIGXFSZ is ignored so the write fails instead of killing the process). Phase 1 fills the disk
in the middle of a run, during a flush; phase 2 fills it before the final write of close().
One child run serves all tests of this file: a process forked from an interpreter that imported
torch (tests/forked_jobs.py), its limit its own."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from recorder_testlib import open_trace

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE, SIGXFSZ")

N_STEPS = 300
SHORT_TIMEOUT = 2.0

CHILD = textwrap.dedent(f"""
    import os, resource, signal, sys, time, warnings
    import torch
    from torch import nn
    from torchautopsy import Recorder

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    torch.set_num_threads(1)  # tiny model on a small shared machine: no OpenMP contention
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        # Phase 1: the file cannot grow past its size after the first flush. It needs to grow
        # again (new chunks) some tens of steps later: the flush that needs it fails mid-run.
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(20)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        run1 = os.path.join(sys.argv[1], "run1")
        rec = Recorder(model, run1, flush_every_s=3600.0, activations_every=1)
        for step in range({N_STEPS}):
            loss = model(torch.randn(8, 64)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
            print("LOSS", step, repr(float(loss.detach())), flush=True)
            if step % 5 == 4 and rec.writer.error is None:
                t0 = time.monotonic()
                rec.writer.flush(timeout={SHORT_TIMEOUT})  # what rec.flush() does, with 30 s
                print("FLUSH_S", round(time.monotonic() - t0, 3), flush=True)
                if rec.writer.error is None:
                    print("FLUSHED", step + 1, flush=True)
                if step == 4:
                    size = os.path.getsize(os.path.join(run1, "rank0.h5"))
                    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        rec.close()
        print("DONE", step, flush=True)
        n1 = len([w for w in caught if "torchautopsy" in str(w.message)])
        print("WARNINGS1", n1, flush=True)

        # Phase 2: nothing flushed yet, and the disk is full before close() writes the rows.
        model2 = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        opt2 = torch.optim.SGD(model2.parameters(), lr=1e-3)
        run2 = os.path.join(sys.argv[1], "run2")
        rec2 = Recorder(model2, run2)  # default flush_every_s: nothing is written for 5 s
        size2 = os.path.getsize(os.path.join(run2, "rank0.h5"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size2, size2))
        for step in range(5):
            loss = model2(torch.randn(4, 8)).pow(2).mean()
            opt2.zero_grad()
            loss.backward()
            opt2.step()
            rec2.step(loss=loss)
        t0 = time.monotonic()
        rec2.writer.close({{"closed": True, "end_reason": "closed"}}, timeout={SHORT_TIMEOUT})  # rec2.close(), with 60 s
        print("CLOSE_S", round(time.monotonic() - t0, 3), flush=True)
        rec2.close()
        print("DONE2", flush=True)
    print("WARNINGS", len([w for w in caught if "torchautopsy" in str(w.message)]) - n1, flush=True)
""")


@pytest.fixture(scope="module")
def disk_full(job_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diskfull")
    script = tmp / "child.py"
    script.write_text(CHILD)
    r = job_server.run([sys.executable, str(script), str(tmp)], capture_output=True, text=True,
                       timeout=300, cwd=tmp)
    out = {"losses": [], "flushed": 0, "flush_s": [], "rc": r.returncode, "stdout": r.stdout,
           "stderr": r.stderr, "run1": tmp / "run1" / "rank0.h5"}
    for line in r.stdout.splitlines():
        key, *rest = line.split()
        if key == "LOSS":
            out["losses"].append(float(rest[1]))
        elif key == "FLUSHED":
            out["flushed"] = int(rest[0])
        elif key == "FLUSH_S":
            out["flush_s"].append(float(rest[0]))
        elif key in ("WARNINGS1", "WARNINGS", "CLOSE_S"):
            out[key] = float(rest[0])
        elif key in ("DONE", "DONE2"):
            out[key] = True
    return out


def test_training_goes_on_and_the_flushed_steps_read_back(disk_full):
    d = disk_full
    assert d.get("DONE") and d.get("DONE2"), d["stdout"][-2000:] + d["stderr"][-2000:]
    assert len(d["losses"]) == N_STEPS and np.isfinite(d["losses"]).all()
    assert d.get("WARNINGS1", 0) >= 1, "the disk-full fault did not happen: the test tests nothing"
    assert 5 <= d["flushed"] < N_STEPS, d["flushed"]
    with open_trace(d["run1"]) as f:
        steps, loss = f["steps/step"][:], f["steps/loss"][:]
        # every row flushed before the disk filled reads back, exactly (rows after it may or
        # may not be there)
        assert len(steps) >= d["flushed"]
        np.testing.assert_array_equal(steps[: d["flushed"]], np.arange(d["flushed"]))
        np.testing.assert_array_equal(loss[: d["flushed"]], d["losses"][: d["flushed"]])
        assert np.isfinite(f["params/grad_norm"][: d["flushed"]]).all()


def test_flush_returns_promptly_when_its_write_fails(disk_full):
    assert disk_full["flush_s"], "no flush ran"
    assert max(disk_full["flush_s"]) < SHORT_TIMEOUT / 2, disk_full["flush_s"]


def test_close_returns_promptly_when_its_write_fails(disk_full):
    assert "CLOSE_S" in disk_full, disk_full["stdout"][-2000:]
    assert disk_full["CLOSE_S"] < SHORT_TIMEOUT / 2, disk_full["CLOSE_S"]


def test_disk_full_does_not_crash_the_job(disk_full):
    assert disk_full.get("DONE2")
    assert disk_full["rc"] == 0, (disk_full["rc"], disk_full["stderr"][-2000:])


def test_disk_full_warns_once(disk_full):
    assert disk_full.get("WARNINGS1") == 1, disk_full.get("WARNINGS1")
