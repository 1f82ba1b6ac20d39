"""Issue 21: DDP and FSDP2 launched by torchrun (2 processes, gloo on the CPU).

One trace per rank; the recorder adds no collective (a job in which one rank records and the
other does not still runs, with the same losses: a collective of the recorder's would hang it);
FSDP2's sharded parameters are measured by each rank's shard, marked so, and the analyzer's
whole-parameter figures equal the norms of the full parameters; a NaN planted in rank 1's batch
is reported on rank 1 first.

The four jobs compared (DDP and FSDP2, recorded by both ranks, by one, by none) are trained one
after the other in one torchrun job (torchrun_train.py), the unrecorded ones first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from torchautopsy import load
from tests.helpers import invoke_cli
from tests.integrations.common import no_stragglers_config

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo on Linux/macOS")
SCRIPT = Path(__file__).with_name("torchrun_train.py")
BAD = 6  # torchrun_train.BAD


# Unrecorded first: nothing of a recorder's (closed) can be left in the process when they train.
JOBS = ["ddp:none", "fsdp:1", "ddp:0,1", "fsdp:0,1"]


@pytest.fixture(scope="module")
def jobs() -> dict[str, tuple[Path, list[dict], str]]:
    """MODE_RECORDING (ddp_01, ddp_none, fsdp_01, fsdp_1): (run directory, each rank's out.json,
    the torchrun job's stderr), of one 2-process torchrun job that trains them all."""
    root = Path(tempfile.mkdtemp(prefix="torchrun_train_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    # --standalone: the rendezvous binds a port of its own choosing (no race for a port picked here)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), str(root), *JOBS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, _first_errors(r.stderr)
    found = {}
    for job in JOBS:
        d = root / job.replace(":", "_").replace(",", "")
        found[d.name] = d / "run", [json.loads((d / f"out.json.rank{k}").read_text()) for k in (0, 1)], r.stderr
    return found


def _first_errors(stderr: str) -> str:
    """The ranks' own lines first (a rank's traceback, an abort), then torchrun's summary's end."""
    ranks = [line for line in stderr.splitlines() if line.startswith("[rank") or "terminate" in line]
    return "\n".join(ranks[:40]) + "\n...\n" + stderr[-1500:]


def _ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "torchautopsy" in line]


def _nan_reported_on_rank_1_first(run: Path) -> None:
    # In this process, torch hidden (the CLI's own interpreter without torch: tests/reports/test_report_cli.py)
    r = invoke_cli("analyze", run, "--json", run.parent / "f.json", "--config", no_stragglers_config(run.parent),
                   block_torch=True)
    assert r.returncode == 0, r.stderr
    assert "rank 1 went wrong first: nonfinite at step 6 (batch)" in r.stdout, r.stdout
    bad = [f for f in json.loads((run.parent / "f.json").read_text())["findings"] if f["kind"] == "nonfinite"]
    assert {(f["rank"], f["step"]) for f in bad} == {(0, BAD), (1, BAD)}
    first = [f for f in bad if f["rank"] == 1][0]
    assert first["evidence"]["stage"] == "batch"


def test_ddp_one_trace_per_rank_and_the_nan_on_its_rank_first(jobs):
    run, outs, stderr = jobs["ddp_01"]
    assert sorted(os.listdir(run)) == ["rank0.h5", "rank1.h5"] and _ours(stderr) == []
    trace = load(run)
    for k in (0, 1):
        rt = trace.ranks[k]
        assert rt.rank == k and rt.closed_cleanly and rt.meta["world_size"] == 2
        assert rt.step_index.tolist() == list(range(10))
        np.testing.assert_array_equal(rt.steps["loss"].to_numpy()[:BAD], outs[k]["losses"][:BAD])
        assert (rt.param_shards == 1).all()  # DDP: every rank holds the whole parameters
    _nan_reported_on_rank_1_first(run)


def test_ddp_recorded_trains_bitwise_as_unrecorded_though_its_gradients_go_through_our_hook(jobs):
    """The recorder takes each rank's own gradient norm in a DDP communication hook that then runs
    DDP's default all-reduce (recorder/distributed/local_grads.py): the losses are the same to the bit with both
    ranks recording and with none."""
    run, outs, _ = jobs["ddp_01"]
    assert load(run).ranks[0].meta["local_grad_norms"] == "recorded"
    bare_run, bare, stderr = jobs["ddp_none"]
    assert not bare_run.exists() and _ours(stderr) == []
    for k in (0, 1):
        assert bare[k]["losses"][:BAD] == outs[k]["losses"][:BAD], k


def test_fsdp2_shards_are_marked_and_combined_into_whole_parameters(jobs):
    run, outs, stderr = jobs["fsdp_01"]
    assert _ours(stderr) == []
    trace = load(run)
    names = outs[0]["names"]
    for k in (0, 1):
        own = trace.attempts[k][0].trace  # the rank's file as written: its shard's figures
        assert own.param_names == names and (own.param_shards == 2).all()
        assert own.meta["n_parameters"] == 32 * 8 + 32 + 32 * 32 + 32 + 4 * 32 + 4  # whole, not the shard
        whole = trace.ranks[k]
        for stat in ("grad_norm", "param_norm"):
            expected = np.array(outs[0][stat][:BAD])  # the full parameters' norms (full_tensor())
            got = whole.param_stat(stat).to_numpy()[:BAD]
            measured = got[:, 0] >= 0  # (weights: on watched steps, 0 and 5, and before an update ratio)
            assert measured.sum() >= 2
            np.testing.assert_allclose(got[measured], expected[measured], rtol=1e-5)
            shard = own.param_stat(stat).to_numpy()[:BAD]
            assert (shard[measured] < got[measured] * (1 - 1e-3)).any()  # a shard's norm is not the whole's
        np.testing.assert_allclose(whole.digest.total_grad_norm[:BAD],
                                   np.sqrt((np.array(outs[0]["grad_norm"][:BAD]) ** 2).sum(axis=1)), rtol=1e-5)
    _nan_reported_on_rank_1_first(run)


def test_fsdp2_one_rank_recording_alone_neither_blocks_nor_changes_the_job(jobs):
    """Only rank 1 records: any collective of the recorder's would wait forever for rank 0."""
    _, outs, _ = jobs["fsdp_01"]
    run, alone, stderr = jobs["fsdp_1"]
    assert os.listdir(run) == ["rank1.h5"] and _ours(stderr) == []
    for k in (0, 1):
        assert alone[k]["losses"][:BAD] == outs[k]["losses"][:BAD]
        assert np.isnan(alone[k]["losses"][BAD]) == (k == 1)
