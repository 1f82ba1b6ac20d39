"""Issue 38 (1), under DDP: with the recorder on, each rank's exit status is what it is without it.

A DDP job of 2 gloo ranks (launched directly with env://, rank 0 hosting the store: torchrun's
agent would add ~3 s a job) ends in each way the recorder can see it end: closed by rec.close(),
never closed (the atexit hook closes the trace), an uncaught error in the loop, SIGTERM during
training. Each path runs bare and recorded; every rank's exit status must be the bare job's, no
rank may abort ("terminate called without an active exception": a thread left to the
interpreter's shutdown), the trace must be closed with the path's end reason, and no thread of the
recorder may still be alive when the job's last exit handler runs (the job registers one before
the Recorder, so it runs after the recorder's).

Each rank is a process of its own, forked by one interpreter that imported torch once
(the suite's job server, tests/forked_jobs.py: its torch._dynamo brings DDP's modules): a fresh one paid ~4.5 CPU-s before its first
step, 16 of them 70 of the test's 84 CPU-s. The rank then runs JOB as `python -c JOB` would, at
the module's level, and ends as it would: JOB's uncaught error or signal, or its end, then its
exit handlers, the interpreter's finalization (threads, modules) and exit()'s C++ destructors, all
in the rank. The server had one thread when it forked (torch's import starts none; the ranks start
gloo's and the recorder's) and never imports torchautopsy.

Not reproduced here: on the main before this test (2 cores, heavily loaded by other jobs) the
healthy recorded job aborted in 0 of 70 runs (torchrun: 30 of a 4-step job, 20 of
torchrun_train.py's DDP job with its normal interpreter exit; direct launch: 20 of a 14-step job
without destroy_process_group), the bare job in 0 of 50; never-closed, exception and SIGTERM
jobs exited as the bare ones. An LD_PRELOAD tracer of pthread_exit (what CPython 3.11 calls when
a thread takes the GIL during finalization: the known source of this abort) saw no thread do so
in the direct-launch jobs it watched (fresh interpreters then). This test keeps it so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import h5py
import pytest

from tests.forked_jobs import JobServer, kill_group
from tests.helpers import REPEAT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo ranks, signals")

STEPS = 12  # past the first profiler window (steps 10-11): kineto's thread is there at exit too

JOB = textwrap.dedent(f"""
    import atexit, os, signal, sys, threading

    def ours_left():  # registered first, so it runs last: after the recorder's own exit hook
        left = [t.name for t in threading.enumerate() if t.name.startswith("torchautopsy")]
        print("threads left:", left, flush=True)

    atexit.register(ours_left)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    run_dir, recorded, path = sys.argv[1], sys.argv[2] == "recorded", sys.argv[3]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    rec = None
    if recorded:
        from torchautopsy import Recorder
        rec = Recorder(model, run_dir, heartbeat_s=0.2)
    for step in range({STEPS}):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = F.cross_entropy(model(torch.randn(8, 8, generator=g)), torch.randint(0, 4, (8,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rec is not None:
            rec.step(loss=loss)
        if step == {STEPS} - 2 and path == "exception":
            raise RuntimeError("the job's own error")
        if step == {STEPS} - 2 and path == "sigterm":  # (both ranks: neither waits for the other)
            os.kill(os.getpid(), signal.SIGTERM)
    if rec is not None and path == "closed":
        rec.close()
    dist.barrier()
    dist.destroy_process_group()
    print("done", flush=True)
""")

END_REASON = {"closed": "closed", "never_closed": "exit", "exception": "exception: RuntimeError",
              "sigterm": "sigterm"}
STATUS = {"closed": 0, "never_closed": 0, "exception": 1, "sigterm": -15}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(server: JobServer, path: str, mode: str) -> tuple[tuple[int, int], list[str], str]:
    """(exit statuses of ranks 0 and 1, their outputs, run directory) of one 2-rank job."""
    for attempt in range(3):  # (a port taken between _free_port() and rank 0's bind: run it again)
        root = tempfile.mkdtemp(prefix=f"ddp_exit_{path}_")
        port = _free_port()
        ranks = []
        for rank in (0, 1):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
            with open(f"{root}/out{rank}", "w") as out:
                ranks.append(server.popen([sys.executable, "-c", JOB, root + "/run", mode, path],
                                          stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + 120
        try:
            statuses = tuple(r.wait(timeout=max(0.0, deadline - time.monotonic())) for r in ranks)
        except subprocess.TimeoutExpired:
            for r in ranks:
                kill_group(r.pid)
            pytest.fail(f"{path}, {mode}: the job ran past 120 s")
        outs = [open(f"{root}/out{rank}").read() for rank in (0, 1)]
        if not any("EADDRINUSE" in o or "address already in use" in o.lower() for o in outs):
            break
    return statuses, outs, root + "/run"


def _check(path: str, statuses: tuple[int, int], outs: list[str]) -> None:
    shown = "\n=====\n".join(o[-3000:] for o in outs)
    assert statuses == (STATUS[path],) * 2, shown
    for out in outs:
        assert "terminate called" not in out, shown
        if path != "sigterm":  # (SIGTERM's default action: no exit handler runs, bare or recorded)
            assert "threads left: []" in out, shown


@pytest.mark.parametrize("path", ["closed", "never_closed", "exception", "sigterm"])
def test_every_rank_exits_as_the_bare_job_does(job_server, path):
    statuses, outs, _ = _job(job_server, path, "bare")
    _check(path, statuses, outs)
    # The healthy job most often: an abort at exit was seen in about 1 of 5 such runs (issue 38;
    # 0 in 110 since its fix): REPEAT times (tests/helpers.py).
    for _ in range(REPEAT):
        statuses, outs, run = _job(job_server, path, "recorded")
        _check(path, statuses, outs)
        assert sorted(os.listdir(run)) == ["rank0.h5", "rank1.h5"], outs
        for rank in (0, 1):
            with h5py.File(f"{run}/rank{rank}.h5", "r", swmr=True) as f:
                assert bool(f.attrs["closed"]), (rank, dict(f.attrs))
                assert str(f.attrs["end_reason"]).startswith(END_REASON[path]), (rank, f.attrs["end_reason"])
