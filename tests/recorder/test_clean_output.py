"""A recorded job prints nothing that the bare job does not.

With profiler windows on, every window used to print kineto's own log lines on stderr
("USDT: ... profiler_start" / "profiler_stop"; "STAGE: ... Completed Stage" in older torch) and
the CPU allocator's "[W... CPUAllocator.cpp] Memory block of unknown size was allocated before the
profiling started". The same training runs bare and recorded, each in a process of its own that
never ran a profiler (kineto reads its log level once, when the process's first profiler starts):
forked from an interpreter that imported torch and nothing else (tests/forked_jobs.py). Their
outputs must be equal; the job's own prints, warnings and logging during the windows must still
come through."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap


TRAIN = textwrap.dedent("""
    import logging, sys, warnings
    import torch
    from torch import nn

    mode, run_dir = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    log = logging.getLogger("job")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = None
    if mode == "recorded":
        from torchautopsy import Recorder
        # Windows at steps 2-3, 6-7, 10-11, 14-15: the job's own output below lands inside them.
        rec = Recorder(model, run_dir, profile_first=2, profile_steps=2, profile_every=4)
    for step in range(16):
        x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        if rec is not None:
            rec.step(loss=loss)
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        if step % 4 == 3:
            log.info("checkpoint at step %d", step)
            print(f"stderr line {step}", file=sys.stderr, flush=True)
        if step == 7:
            warnings.warn("the job's own warning", UserWarning)
    if rec is not None:
        rec.close()
    print("done", flush=True)
""")


def _run(jobs, mode: str, run_dir: str) -> subprocess.CompletedProcess:
    return jobs.run([sys.executable, "-c", TRAIN, mode, run_dir], capture_output=True, text=True, timeout=240)


def test_a_recorded_job_prints_what_the_bare_job_prints(jobs):
    root = tempfile.mkdtemp(prefix="prof_")
    try:
        bare, recorded = _run(jobs, "bare", root + "/bare"), _run(jobs, "recorded", root + "/rec")
        assert bare.returncode == 0, bare.stderr[-3000:]
        assert recorded.returncode == 0, recorded.stderr[-3000:]
        # The job's own output is all there (the recorder silenced nothing of it) ...
        assert "step 15 loss" in bare.stdout and "done" in bare.stdout
        for line in ("INFO job checkpoint at step 7", "stderr line 11", "the job's own warning"):
            assert line in bare.stderr, line
        # ... and the recorded job adds nothing to it, on either stream.
        assert recorded.stdout == bare.stdout
        assert recorded.stderr == bare.stderr, "\n--- bare:\n" + bare.stderr + "\n--- recorded:\n" + recorded.stderr

        from torchautopsy import load

        rt = load(root + "/rec").ranks[0]
        assert rt.n_steps == 16
        assert len(rt.profile_windows) == 4  # the windows did run
    finally:
        shutil.rmtree(root, ignore_errors=True)
