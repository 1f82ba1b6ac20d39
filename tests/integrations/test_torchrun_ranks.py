"""Failures only a job of several ranks has, planted on one rank of a DDP job that torchrun
launches (gloo on the CPU, a real DataLoader): a straggler (a slow loader on rank 2), a silent
replica divergence (a weight nudged on rank 1), a hang (rank 1 stops before a collective, the job
is ended by gloo's timeout) and a NaN in one rank's batch. Every scenario runs in one job, each
from scratch with its own trace (torchrun_ranks.py); the hang, which ends the job, runs last.

Each test checks what the recorder wrote (read with h5py: the step-time split, the replica
fingerprints, the heartbeat rows and their stacks), then what the real CLI finds in it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.helpers import invoke_cli
from tests.integrations.common import no_stragglers_config

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo on Linux/macOS")
SCRIPT = Path(__file__).with_name("torchrun_ranks.py")
# As in torchrun_ranks.py:
SLOW, SLOW_S = 8, 0.15
DIVERGE, PERTURBED = 6, "module.2.weight"
HANG, TIMEOUT_S = 5, 8
BAD = 6
STEPS = {"straggler": 20, "divergence": 12, "hang": 10, "nan": 10, "backward_nan": 10, "backward_nan_fsdp": 10}


def _line(marker: str) -> int:
    """The line of torchrun_ranks.py that ends with `# MARKER`."""
    lines = SCRIPT.read_text().splitlines()
    hits = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


class Job:
    def __init__(self, root: Path, returncode: int, stdout: str, stderr: str, seconds: float):
        self.root = root
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds

    def errors(self) -> str:
        """The ranks' own lines first (a rank's traceback, an abort), then torchrun's summary's end."""
        ranks = [line for line in self.stderr.splitlines() if line.startswith("[rank") or "terminate" in line]
        return "\n".join(ranks[:40]) + "\n...\n" + self.stderr[-1500:]

    def run(self, scenario: str) -> Path:
        return self.root / scenario / "run"

    def ours(self) -> list[str]:
        """The job's output lines that the recorder printed: there must be none."""
        return [line for line in (self.stdout + self.stderr).splitlines() if "torchautopsy" in line]


def torchrun(scenarios: str, nproc: int, limit_s: float = 120) -> Job:
    """Run one job (scenarios: comma-separated, run one after the other); past limit_s, kill the
    whole process group (torchrun and every rank): nothing here can leave processes behind or hang
    the suite."""
    root = Path(tempfile.mkdtemp(prefix="torchrun_ranks_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    # --standalone: the rendezvous binds a port of its own choosing (no race for a port picked here)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), str(root), scenarios]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"{scenarios}: the job ran past {limit_s} s and was killed\n{stderr[-3000:]}")
    finally:
        try:  # (a rank that outlived torchrun)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Job(root, p.returncode, stdout, stderr, time.monotonic() - t0)


def _open(path: Path) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except OSError:  # (a file its writer never closed: readable in SWMR mode)
        return h5py.File(path, "r", swmr=True)


def _text(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


def read_rank(run: Path, rank: int) -> dict:
    """What the recorder wrote for one rank: its attributes, parameter names, steps table,
    fingerprints and heartbeat rows (stacks parsed: [[file, line, function, code], ...])."""
    with _open(run / f"rank{rank}.h5") as f:
        hb = f["heartbeats"]
        return {
            "attrs": dict(f.attrs),
            "names": _text(f["params/name"][()]),
            "steps": {k: f["steps"][k][()] for k in f["steps"]},
            "fp_steps": f["fingerprints/step"][()],
            "fp_bits": f["fingerprints/bits"][()],
            "heartbeats": [{"step": int(s), "phase": ph, "phase_s": float(a), "step_s": float(b),
                            "typical_step_s": float(c), "stack": json.loads(st) if st else None}
                           for s, ph, a, b, c, st in zip(hb["step"][()], _text(hb["phase"][()]), hb["phase_s"][()],
                                                        hb["step_s"][()], hb["typical_step_s"][()],
                                                        _text(hb["stack"][()]))],
        }


def read_run(run: Path, nproc: int) -> list[dict]:
    assert sorted(os.listdir(run)) == [f"rank{k}.h5" for k in range(nproc)]
    ranks = [read_rank(run, k) for k in range(nproc)]
    for k, r in enumerate(ranks):
        assert r["attrs"]["rank"] == k and r["attrs"]["world_size"] == nproc
    return ranks


@pytest.fixture(scope="module")
def job() -> Job:
    """One job of 3 ranks for every scenario, the hang last (~25 CPU-s; ~15 more a job each)."""
    return torchrun("straggler,divergence,nan,backward_nan,backward_nan_fsdp,hang", 3, limit_s=300)


@pytest.mark.parametrize("scenario", ["backward_nan", "backward_nan_fsdp"])
def test_nan_born_in_rank_2s_own_backward_is_told_by_its_gradients_before_the_collective(job, scenario):
    """DDP: the bucket norms of a communication hook; FSDP2: the input of each parameter group's
    reduce-scatter. Either way rank 2's own gradients are NaN, the others' finite."""
    ranks = _finished(job, scenario, 3)
    for r in ranks:
        assert np.isfinite(r["steps"]["loss"][:BAD + 1]).all(), r["steps"]["loss"]  # the forward never saw it
        assert r["attrs"]["local_grad_norms"] == "recorded"
    local = [r["steps"]["local_grad_norm"] for r in ranks]
    # Step 0 runs before the hook is registered; then every rank's own norm, until the bad step,
    # where only rank 2's is NaN (its replicas' NaN only after the collective).
    for k in range(3):
        assert np.isnan(local[k][0]) and np.isfinite(local[k][1:BAD]).all() and (local[k][1:BAD] > 0).all()
    assert not np.allclose(local[0][1:BAD], local[1][1:BAD])  # (each rank's own batch: not the average)
    assert np.isnan(local[2][BAD]) and np.isfinite(local[0][BAD]) and np.isfinite(local[1][BAD])

    found, stdout = findings(job.run(scenario), stragglers=False)
    bad = [f for f in found if f["kind"] == "nonfinite"]
    assert (bad[0]["rank"], bad[0]["step"]) == (2, BAD), bad
    assert bad[0]["evidence"]["ranks"] == [0, 1, 2], bad[0]
    assert "rank 2's own gradients held NaN" in bad[0]["evidence"]["local_first"], bad[0]
    assert "rank 2 went wrong first" in stdout, stdout


def findings(run: Path, stragglers: bool = True) -> tuple[list[dict], str]:
    """(findings, stdout) of `torchautopsy analyze RUN --json F`, torch hidden from it (in this
    process: the CLI's own interpreter without torch is tested in tests/reports/test_report_cli.py);
    without the straggler detector's findings where the claim is which rank's NaN came first."""
    out = run.parent / "findings.json"
    config = () if stragglers else ("--config", no_stragglers_config(run.parent))
    r = invoke_cli("analyze", run, "--json", out, *config, block_torch=True)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["findings"], r.stdout


def _finished(job: Job, scenario: str, nproc: int) -> list[dict]:
    """A scenario that ran to its end: every rank's trace of it closed, with every step, and the
    rank then went on to the next scenario (the job itself is ended by the hang, its last)."""
    assert job.ours() == []
    for k in range(nproc):
        assert (job.run(scenario).parent / f"out.rank{k}").exists(), job.errors()
    ranks = read_run(job.run(scenario), nproc)
    for r in ranks:
        assert r["attrs"]["closed"] and r["attrs"]["end_reason"] == "closed", r["attrs"].get("end_reason")
        assert r["steps"]["step"].tolist() == list(range(STEPS[scenario]))
    return ranks


def test_straggler_rank_2_waits_for_its_data_and_the_others_wait_for_it(job):
    ranks = _finished(job, "straggler", 3)
    wait = [r["steps"]["data_wait_s"] for r in ranks]
    backward = [r["steps"]["backward_s"] for r in ranks]
    # Rank 2: its loader sleeps SLOW_S in every batch from step SLOW on, and only then.
    assert (wait[2][SLOW:] >= SLOW_S * 0.95).all(), wait[2]
    assert np.median(wait[2][:SLOW]) < SLOW_S / 3, wait[2]
    for k in (0, 1):
        assert np.median(wait[k]) < SLOW_S / 3, (k, wait[k])
        # ...the others wait for rank 2 in the gradient all-reduce: their backward grows by as much
        assert np.median(backward[k][SLOW:]) > SLOW_S * 0.6, (k, backward[k])
        assert np.median(backward[k][:SLOW]) < SLOW_S / 3, (k, backward[k])
    assert np.median(backward[2][SLOW:]) < SLOW_S / 3, backward[2]

    found, _ = findings(job.run("straggler"))
    slow = [f for f in found if f["kind"] == "straggler"]
    assert [(f["rank"], f["step"]) for f in slow] == [(2, SLOW)], found
    assert slow[0]["evidence"]["phase"] == "data", slow[0]


def test_divergence_rank_1_leaves_the_replicas_at_its_step_in_the_perturbed_parameter(job):
    ranks = _finished(job, "divergence", 3)
    names = ranks[0]["names"]
    assert all(r["names"] == names for r in ranks) and PERTURBED in names, names
    col = names.index(PERTURBED)
    for r in ranks:  # a fingerprint on every step (fingerprint_every=1)
        assert r["fp_steps"].tolist() == list(range(STEPS["divergence"]))
        assert r["fp_bits"].shape == (STEPS["divergence"], len(names))
    bits = [r["fp_bits"] for r in ranks]
    # Ranks 0 and 2 stay replicas throughout; rank 1 is one of them before step DIVERGE...
    np.testing.assert_array_equal(bits[0], bits[2])
    np.testing.assert_array_equal(bits[1][:DIVERGE], bits[0][:DIVERGE])
    # ...and differs from it on, in the nudged parameter only (gradients stay averaged: the same update).
    differs = bits[1] != bits[0]
    assert differs[DIVERGE:, col].all(), differs
    assert not np.delete(differs, col, axis=1).any(), differs

    found, _ = findings(job.run("divergence"))
    div = [f for f in found if f["kind"] == "replica_divergence"]
    assert [(f["rank"], f["step"]) for f in div] == [(1, DIVERGE)], found
    assert PERTURBED in div[0]["where"], div[0]


def test_hang_rank_1_stops_before_its_forward_the_others_wait_in_backward_until_the_timeout(job):
    """Rank 1 sleeps before the forward of step HANG; ranks 0 and 2 go into it and block in the
    gradient all-reduce of loss.backward() until gloo's timeout (TIMEOUT_S) raises there. They die
    of it, and torchrun then stops rank 1 (SIGTERM): the job is ended as a real one is."""
    assert job.returncode != 0 and "Timed out" in job.stderr, job.errors()
    assert job.ours() == []
    ranks = read_run(job.run("hang"), 3)
    hang_line, backward_line = _line("HANG"), _line("BACKWARD")
    for k, r in enumerate(ranks):
        assert r["steps"]["step"].tolist() == list(range(HANG)), k  # steps before HANG, all flushed
        assert r["fp_steps"].tolist() == list(range(HANG))
        # (A step before HANG that took longer than a heartbeat has rows too: step 0, whose
        # rec.step() takes ~0.5 s on this machine, often does.)
        assert all(b["step"] < HANG for b in r["heartbeats"] if b["step"] != HANG), (k, r["heartbeats"])
        beats = [b for b in r["heartbeats"] if b["step"] == HANG]
        # A row every heartbeat (0.5 s) once the step is overdue, until the rank died (>= ~8 s).
        assert len(beats) >= 8, (k, beats)
        assert max(b["step_s"] for b in beats) > TIMEOUT_S * 0.75, (k, beats)
        assert {b["phase"] for b in beats} == {"between_steps" if k == 1 else "backward"}, (k, beats)
        # The stack is sampled once the step is overdue, and written when it changed: once here.
        stacks = [b["stack"] for b in beats if b["stack"] is not None]
        assert len(stacks) == 1, (k, beats)
        ours = [fr for fr in stacks[0] if Path(fr[0]).resolve() == SCRIPT.resolve()]
        assert ours, stacks[0]
        if k == 1:  # innermost frame: the sleep (time.sleep is C: no frame of its own)
            assert stacks[0][-1][:3] == [str(SCRIPT), hang_line, "<module>"], stacks[0]
        else:  # in loss.backward(), down into the autograd engine, where the all-reduce is waited for
            assert ours[-1][1] == backward_line, stacks[0]
            assert stacks[0][-1][2] == "_engine_run_backward", stacks[0]
    # The waiting ranks died of the timeout (the recorder closed their files saying so); rank 1
    # was stopped by torchrun.
    for k in (0, 2):
        assert ranks[k]["attrs"]["end_reason"].startswith("exception: RuntimeError"), ranks[k]["attrs"]
    assert ranks[1]["attrs"]["end_reason"] == "sigterm", ranks[1]["attrs"]

    found, _ = findings(job.run("hang"))
    hangs = [f for f in found if f["kind"] == "hang"]
    assert [(f["rank"], f["step"]) for f in hangs] == [(1, HANG)], found
    evidence = json.dumps(hangs[0]["evidence"])
    assert f"torchrun_ranks.py:{hang_line}" in evidence, hangs[0]
    assert "backward" in evidence, hangs[0]


def test_nan_in_rank_1s_batch_is_reported_on_rank_1_first(job):
    ranks = _finished(job, "nan", 3)
    assert ranks[1]["steps"]["batch_nonfinite"].tolist() == [int(s == BAD) for s in range(STEPS["nan"])]
    for k in (0, 2):
        assert not ranks[k]["steps"]["batch_nonfinite"].any()
        assert np.isfinite(ranks[k]["steps"]["loss"][BAD])
    for r in ranks:
        loss = r["steps"]["loss"]
        assert np.isfinite(loss[:BAD]).all() and np.isnan(loss[BAD + 1:]).all()
    assert np.isnan(ranks[1]["steps"]["loss"][BAD])

    found, stdout = findings(job.run("nan"), stragglers=False)
    bad = [f for f in found if f["kind"] == "nonfinite"]
    assert (bad[0]["rank"], bad[0]["step"]) == (1, BAD), bad
    assert bad[0]["evidence"]["stage"] == "batch", bad[0]
    assert "rank 1 went wrong first" in stdout, stdout
