"""The many-rank cases of make_samples.py: a DDP job of 4 ranks (gloo, CPU) launched by torchrun
(ddp_job.py). ddp_straggler: one rank's data loading slows down from step SLOW_FROM; ddp_hang:
one rank's data loading blocks at step HANG_STEP and the job ends by gloo's timeout. The ground
truth (kind, step, rank) is by construction, and checked in the traces the job wrote."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np

import ddp_job

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 4


def _launch(case: str, run_dir: str, expect_ok: bool) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           os.path.join(HERE, "ddp_job.py"), case, run_dir]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if (r.returncode == 0) != expect_ok:
        raise SystemExit(f"{case}: torchrun exited {r.returncode}\n{r.stderr[-3000:]}")
    if "torchautopsy" in r.stdout + r.stderr:
        raise SystemExit(f"{case}: the recorder printed into the job's output")
    found = sorted(os.listdir(run_dir))
    if found != sorted(f"rank{k}.h5" for k in range(RANKS)):
        raise SystemExit(f"{case}: the run directory holds {found}")


def _steps(run_dir: str, rank: int) -> dict:
    with h5py.File(os.path.join(run_dir, f"rank{rank}.h5"), "r") as f:
        out = {c: f[f"steps/{c}"][:] for c in ("step", "data_wait_s", "backward_s")}
        out["heartbeats"] = {c: f[f"heartbeats/{c}"][:] for c in ("step", "phase")}
        out["attrs"] = dict(f.attrs)
    return out


def ddp_straggler(run_dir: str) -> dict:
    """4 ranks, 150 steps; rank 1's batches take 30 ms longer to load from step 60 (a busier host).
    The others' backward grows by as much: they wait for it in the gradient all-reduce."""
    _launch("ddp_straggler", run_dir, expect_ok=True)
    s = [_steps(run_dir, r) for r in range(RANKS)]
    slow, at = ddp_job.SLOW_RANK, ddp_job.SLOW_FROM
    wait = {r: (float(np.median(s[r]["data_wait_s"][1:at])), float(np.median(s[r]["data_wait_s"][at:])))
            for r in range(RANKS)}
    back = {r: (float(np.median(s[r]["backward_s"][1:at])), float(np.median(s[r]["backward_s"][at:])))
            for r in range(RANKS)}
    print(f"  data wait before/after step {at} (ms): " + ", ".join(
        f"rank {r} {1e3 * a:.1f}/{1e3 * b:.1f}" for r, (a, b) in wait.items()))
    print("  backward before/after (ms): " + ", ".join(f"rank {r} {1e3 * a:.1f}/{1e3 * b:.1f}" for r, (a, b) in back.items()))
    if not (wait[slow][1] - wait[slow][0] > 0.8 * ddp_job.SLOW_S):
        raise SystemExit(f"ddp_straggler: rank {slow}'s data wait did not grow ({wait[slow]})")
    return {"kind": "straggler", "step": at, "rank": slow, "where": [],
            "evidence": {"ranks": RANKS, "slow_s": ddp_job.SLOW_S,
                         "data_wait_ms_before_after": {str(r): [round(1e3 * a, 2), round(1e3 * b, 2)]
                                                       for r, (a, b) in wait.items()},
                         "backward_ms_before_after": {str(r): [round(1e3 * a, 2), round(1e3 * b, 2)]
                                                      for r, (a, b) in back.items()}}}


def ddp_hang(run_dir: str) -> dict:
    """4 ranks; at step 40 rank 2's data loading blocks; the other 3 wait in step 40's all-reduce
    until gloo's 10 s timeout ends the job."""
    _launch("ddp_hang", run_dir, expect_ok=False)
    s = [_steps(run_dir, r) for r in range(RANKS)]
    hang, at = ddp_job.HANG_RANK, ddp_job.HANG_STEP
    for r in range(RANKS):
        beats = s[r]["heartbeats"]
        phases = {p.decode() if isinstance(p, bytes) else p for p, st in zip(beats["phase"], beats["step"]) if st == at}
        print(f"  rank {r}: steps 0-{int(s[r]['step'][-1])}, heartbeats in step {at}: "
              f"{int((beats['step'] == at).sum())} ({', '.join(sorted(phases))}), end: {s[r]['attrs'].get('end_reason')}")
        if int(s[r]["step"][-1]) != at - 1 or phases != ({"data"} if r == hang else {"backward"}):
            raise SystemExit(f"ddp_hang: rank {r} did not stop as planted")
    return {"kind": "hang", "step": at, "rank": hang, "where": [],
            "evidence": {"ranks": RANKS, "cause": "rank 2's DataLoader blocks; the others wait in the all-reduce",
                         "timeout_s": 10}}
