"""A killed job still leaves a readable trace: SIGKILL (everything flushed so far reads back)
and SIGTERM (pre-emption: the recorder closes the file, then the process still dies by SIGTERM).

Each job is a process of its own, forked from an interpreter that imported torch
(tests/forked_jobs.py): it imports the recorder itself, and ends by the real signal or the
interpreter's real exit (its exit handlers, an uncaught error's traceback and status)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

from recorder_testlib import attr_str, open_trace
from tests.helpers import invoke_cli

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

CHILD = textwrap.dedent("""
    import sys, time
    import torch
    from torch import nn
    from torchautopsy import Recorder

    torch.set_num_threads(1)  # tiny model on a small shared machine: no OpenMP contention
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = Recorder(model, sys.argv[1], flush_every_s=0.2)
    for step in range(1_000_000):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(loss=loss)
        print(step, repr(float(loss.detach())), flush=True)
        time.sleep(0.002)
""")

MIN_STEPS, MIN_SECONDS, FLUSH_S = 50, 1.5, 0.2


def _run_and_kill(jobs, tmp_path, sig):
    script = tmp_path / "train.py"
    script.write_text(CHILD)
    run_dir = tmp_path / "run"
    errf = open(tmp_path / "stderr.txt", "w")
    proc = jobs.popen([sys.executable, str(script), str(run_dir)], stdout=subprocess.PIPE,
                      stderr=errf, text=True, cwd=tmp_path)
    printed = []  # (step, loss, time read)
    try:
        deadline = time.monotonic() + 120
        while True:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"child ended early: {proc.wait()} {(tmp_path / 'stderr.txt').read_text()}")
            step, loss = line.split()
            printed.append((int(step), float(loss), time.monotonic()))
            if len(printed) >= MIN_STEPS and printed[-1][2] - printed[0][2] >= MIN_SECONDS:
                break
            assert time.monotonic() < deadline, "child too slow"
        t_kill = time.monotonic()
        os.kill(proc.pid, sig)
        for line in proc.stdout:  # whatever it printed between our last read and its death
            step, loss = line.split()
            printed.append((int(step), float(loss), time.monotonic()))
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errf.close()
    assert [p[0] for p in printed] == list(range(len(printed)))
    return rc, printed, t_kill, run_dir / "rank0.h5", (tmp_path / "stderr.txt").read_text()


def test_sigkill_leaves_flushed_steps_readable(jobs, tmp_path):
    rc, printed, t_kill, path, err = _run_and_kill(jobs, tmp_path, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert path.is_file()
    with open_trace(path) as f:  # plain open, or SWMR if HDF5 still sees a writer
        assert bool(f.attrs["closed"]) is False  # never closed: it was killed
        steps = f["steps/step"][:]
        loss = f["steps/loss"][:]
        n = len(steps)
        np.testing.assert_array_equal(steps, np.arange(n))
        assert n <= len(printed) + 1
        # every step printed well before the kill (five flush periods) was flushed
        must_have = sum(1 for p in printed if p[2] < t_kill - 5 * FLUSH_S)
        assert n >= max(10, must_have), (n, must_have, len(printed))
        assert np.isfinite(loss).all()
        k = min(n, len(printed))
        np.testing.assert_array_equal(loss[:k], [p[1] for p in printed[:k]])
        gn = f["params/grad_norm"]
        assert n - 1 <= gn.shape[0] <= n + 1  # tables are flushed together (a row may straddle)
        assert np.isfinite(gn[: min(n, gn.shape[0])]).all()
    # the snapshot of step 0 (written when the Recorder was created) reads back, crc verified
    from torchautopsy import load
    from torchautopsy.analyzer.export import select_params

    rt = load(path).ranks[0]
    assert list(rt.snapshots["step"][:1]) == [0]
    assert set(select_params(rt, 0).tensors) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_sigterm_closes_the_trace_and_still_dies_by_the_signal(jobs, tmp_path):
    rc, printed, _, path, err = _run_and_kill(jobs, tmp_path, signal.SIGTERM)
    assert rc == -signal.SIGTERM, err
    assert "Traceback" not in err, err
    with h5py.File(path, "r") as f:  # closed cleanly: a plain open must work
        assert bool(f.attrs["closed"]) is True
        assert attr_str(f, "end_reason") == "sigterm"
        steps = f["steps/step"][:]
        n = len(steps)
        np.testing.assert_array_equal(steps, np.arange(n))
        # every step the child printed as done was recorded (it may have recorded one more
        # that it did not get to print), and nothing was dropped
        assert len(printed) <= n <= len(printed) + 1, (n, len(printed))
        assert int(f.attrs["n_steps_recorded"]) == n
        assert int(f.attrs["dropped_steps"]) == 0
        np.testing.assert_array_equal(f["steps/loss"][: len(printed)], [p[1] for p in printed])
        # (a signal landing inside rec.step(), between its steps row and the rest, may leave
        # the step's other rows out; never more than that one)
        for table in ("params/grad_norm", "params/param_norm", "modules/output_absmax"):
            assert n - 1 <= f[table].shape[0] <= n, table
        # pre-emption fires the black box: the state and inputs of the step it interrupted
        assert [t.decode() for t in f["blackbox/trigger"][:]] == ["sigterm"]
        assert f["blackbox/params_at"][0].decode() == "at_exit"
        # (inputs and RNG states only if the signal landed inside a step, after its first
        # forward: rec.step() lets go of the step's inputs)
        bb = [r.decode() for r, src in zip(f["tensors/role"][:], f["tensors/source"][:]) if src == b"blackbox"]
        assert bb.count("param") == 4


CHILD_EXIT = textwrap.dedent("""
    import os, signal, sys
    import torch
    from torch import nn
    from torchautopsy import Recorder

    mode = sys.argv[2]
    stop = []
    if mode == "user_handler":  # the job's own graceful-shutdown handler, installed first
        signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    torch.set_num_threads(1)  # tiny model on a small shared machine: no OpenMP contention
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = Recorder(model, sys.argv[1])  # never closed by this script
    for step in range(6):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if mode == "crash" and step == 3:
            raise RuntimeError("data loader died")  # uncaught: the script ends by it
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(loss=loss)
        if mode == "user_handler" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        if stop:
            print("graceful stop after step", step, flush=True)
            break
""")


def _run_child(jobs, tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD_EXIT)
    r = jobs.run([sys.executable, str(script), str(tmp_path / "run"), mode],
                 capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return r, tmp_path / "run" / "rank0.h5"


def test_normal_exit_without_close_closes_the_trace(jobs, tmp_path):
    r, path = _run_child(jobs, tmp_path, "plain")
    assert r.returncode == 0, r.stderr
    with h5py.File(path, "r") as f:
        assert bool(f.attrs["closed"]) is True
        assert attr_str(f, "end_reason") == "exit"
        np.testing.assert_array_equal(f["steps/step"][:], np.arange(6))


def test_sigterm_chains_to_the_jobs_own_handler(jobs, tmp_path):
    """A job with its own SIGTERM handler (graceful shutdown) keeps it: the recorder closes the
    trace and calls it; the process is not killed by the recorder."""
    r, path = _run_child(jobs, tmp_path, "user_handler")
    assert r.returncode == 0, r.stderr
    assert "graceful stop after step 2" in r.stdout, r.stdout + r.stderr
    with h5py.File(path, "r") as f:
        assert bool(f.attrs["closed"]) is True
        assert attr_str(f, "end_reason") == "sigterm"
        np.testing.assert_array_equal(f["steps/step"][:], np.arange(3))



def test_uncaught_exception_fires_the_black_box(jobs, tmp_path):
    """A script that dies by an exception outside any `with Recorder(...)`: the trace is closed
    at exit with the exception as its end, and the black box holds the step it died in (its
    forward had run: its input and torch's RNG state are there)."""
    r, path = _run_child(jobs, tmp_path, "crash")
    assert r.returncode == 1 and "data loader died" in r.stderr
    with h5py.File(path, "r") as f:
        assert attr_str(f, "end_reason").startswith("exception: RuntimeError: data loader died")
        assert [t.decode() for t in f["blackbox/trigger"][:]] == ["exception"]
        assert int(f["blackbox/step"][0]) == 3
        roles = [r.decode() for r, src in zip(f["tensors/role"][:], f["tensors/source"][:]) if src == b"blackbox"]
        assert roles.count("param") == 4 and "input" in roles and "rng" in roles


# One interpreter imports torch and the recorder once, then forks a job for each run directory it
# is sent: each job is a process of its own, killed by SIGKILL while it starts the Recorder (the
# imports are done by then in a real job too), without paying ~4 CPU-s of imports a kill.
STARTING_CHILD = textwrap.dedent("""
    import os, sys, time
    import torch
    from torchautopsy import Recorder

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    print("ready", flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:  # the job
            print(f"started {os.getpid()}", flush=True)
            Recorder(model, line.strip())
            print("recording", flush=True)
            time.sleep(600)
            os._exit(0)
        os.waitpid(pid, 0)
        print("ended", flush=True)
""")


def test_a_job_killed_while_the_recorder_starts_leaves_a_trace_or_says_so(tmp_path):
    """Killed at 0-60 ms into Recorder() (it takes ~50 ms): either rank0.h5 is a readable trace,
    or the analyzer says the job ended before its first flush, never 'truncated or corrupt'."""
    script = tmp_path / "job.py"
    script.write_text(STARTING_CHILD)
    said = set()
    jobs = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert jobs.stdout.readline().strip() == "ready"
    for i, delay in enumerate([*np.linspace(0.0, 0.06, 7), None]):
        run_dir = tmp_path / f"run{i}"
        jobs.stdin.write(f"{run_dir}\n")
        jobs.stdin.flush()
        started = jobs.stdout.readline().split()
        assert started[0] == "started", started
        if delay is None:  # last: after Recorder() returned
            assert jobs.stdout.readline().strip() == "recording"
        else:
            time.sleep(delay)
        os.kill(int(started[1]), signal.SIGKILL)
        while (line := jobs.stdout.readline()).strip() != "ended":  # (its "recording", if it got there)
            assert line, "the process forking the jobs died"
        r = invoke_cli("info", run_dir)  # (in this process: the job's process is the point here)
        if not run_dir.exists() or not os.listdir(run_dir):
            continue  # killed before the recorder made its directory
        if (run_dir / "rank0.h5").exists():
            assert r.returncode == 0, r.stderr
            said.add("trace")
        else:
            assert r.returncode == 2 and "the job ended before its first data was flushed" in r.stderr, r.stderr
            assert "corrupt" not in r.stderr
            said.add("ended early")
    jobs.stdin.close()
    assert jobs.wait(timeout=60) == 0
    assert "trace" in said
