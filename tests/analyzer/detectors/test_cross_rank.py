"""The cross-rank detectors (straggler, replica_divergence, hang) and the merging of the ranks'
findings, on small runs of several ranks in the real format: each planted case found with its
rank and step, and a healthy run of jittery ranks quiet."""

from __future__ import annotations

import numpy as np
import pytest

from torchautopsy.analyzer.cross_rank.merge import rank_set
from tests.tracebuilder import TraceBuilder, findings

STEPS, RANKS = 200, 4
CROSS = ("straggler", "replica_divergence", "hang")
TRAIN = "/job/train.py"


def rank(r: int, seed: int = 0, steps: int = STEPS) -> TraceBuilder:
    """One rank of a healthy data-parallel job: ~100 ms steps with 5% jitter, the same gradients
    (all-reduced), equal fingerprints every 10 steps."""
    rng = np.random.default_rng(1000 * seed + r)
    b = TraceBuilder.mlp(layers=3, steps=steps).attrs(rank=r, world_size=RANKS)
    b.loss(2.0 - np.linspace(0, 1, steps) + rng.normal(0, 0.02, steps)).total_grad_norm(1.0)
    for col, s in (("data_wait_s", 0.005), ("forward_s", 0.03), ("backward_s", 0.06), ("recorder_s", 0.001)):
        b.set(f"steps/{col}", s * (1 + rng.normal(0, 0.05, steps)).clip(0.5))
    b.set("steps/between_steps_s", b.cols["steps/data_wait_s"] + 0.002)
    b.set("steps/rss_bytes", (4e9 + rng.normal(0, 1e6, steps)).astype(np.int64))
    fp_steps = list(range(0, steps, 10))
    bits = np.random.default_rng(seed).integers(-2**62, 2**62, (len(fp_steps), len(b.params)))
    return b.fingerprints(fp_steps, bits)


def write(tmp_path, builders) -> None:
    for r, b in enumerate(builders):
        b.write(tmp_path, rank=r)


def cross(tmp_path) -> list:
    return [f for f in findings(tmp_path) if f.kind in CROSS]


def test_a_healthy_run_of_jittery_ranks_is_quiet(tmp_path):
    write(tmp_path, [rank(r) for r in range(RANKS)])
    assert cross(tmp_path) == []


def test_a_rank_slow_in_its_forward_is_a_straggler_from_its_first_slow_step(tmp_path):
    bs = [rank(r) for r in range(RANKS)]
    bs[3].set("steps/forward_s", 0.08, at=slice(120, None))  # +50 ms, and the others wait for it:
    for b in bs[:3]:
        b.set("steps/backward_s", b.cols["steps/backward_s"] + np.where(b.steps >= 120, 0.05, 0))
    bs[0].set("steps/forward_s", 0.09, at=[30, 31])  # a hiccup on another rank: not a straggler
    write(tmp_path, bs)
    (f,) = cross(tmp_path)
    assert (f.kind, f.rank, f.step, f.severity) == ("straggler", 3, 120, "warning")
    assert f.evidence["phase"] == "forward" and f.evidence["slow_steps"] == 80
    assert f.evidence["others_wait_s"] == pytest.approx(0.05, rel=0.2)


def test_a_replica_that_left_the_others_is_named_with_its_parameters(tmp_path):
    bs = [rank(r) for r in range(RANKS)]
    fp = bs[2].rows["fingerprints"]
    name = bs[2].params[1]
    for row in fp[7:]:  # steps 70, 80, ...: one parameter differs on rank 2
        row["bits"] = row["bits"].copy()
        row["bits"][1] += 1
    write(tmp_path, bs)
    (f,) = cross(tmp_path)
    assert (f.kind, f.rank, f.step, f.where) == ("replica_divergence", 2, 70, [name])
    assert f.evidence["last_agreed_step"] == 60 and f.evidence["majority_ranks"] == 3
    assert "between steps 61 and 70" in f.summary


def test_ranks_that_never_held_the_same_parameters_are_not_replicas(tmp_path):
    write(tmp_path, [rank(r, seed=r) for r in range(RANKS)])  # model parallel: each its own parameters
    assert cross(tmp_path) == []


def _stall(b: TraceBuilder, step: int, phase: str, line: int, code: str, seconds: float = 300) -> TraceBuilder:
    """Heartbeats every 5 s from the end of the last step until the job was killed, the stack
    sampled once (as the recorder writes it), the trace left open."""
    t0 = float(b.cols["steps/time_s"][-1])
    stack = [["/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", 1736, "_call_impl", ""]]
    stack = [[TRAIN, 20, "<module>", "main()"], [TRAIN, line, "main", code]] + (stack if phase == "forward" else [])
    rows = [{"time_unix": t0 + t, "step": step, "phase": phase, "phase_s": t, "step_s": t, "typical_step_s": 0.1,
             "stack": stack if t == 10 else ""} for t in range(5, int(seconds), 5)]
    return b.heartbeats(rows).attrs(closed=False, end_reason="")


def test_a_hang_names_the_rank_that_stopped_first_and_the_line(tmp_path):
    bs = [rank(r, steps=150) for r in range(RANKS)]
    _stall(bs[1], 150, "data", 61, "batch = next(it)")
    for r in (0, 2, 3):
        _stall(bs[r], 150, "backward", 64, "loss.backward()")
    write(tmp_path, bs)
    (f,) = cross(tmp_path)
    assert (f.kind, f.rank, f.step, f.severity) == ("hang", 1, 150, "error")
    assert f.evidence["phase"] == "data" and f.evidence["at"] == "train.py:61"
    assert f.evidence["others"] == [{"ranks": [0, 2, 3], "step": 150, "phase": "backward", "at": "train.py:64",
                                     "code": "loss.backward()"}]
    assert "the other 3 ranks waited in step 150's backward" in f.summary


def test_every_rank_stuck_at_the_same_place_names_no_rank(tmp_path):
    bs = [_stall(rank(r, steps=150), 150, "backward", 64, "loss.backward()") for r in range(RANKS)]
    write(tmp_path, bs)
    (f,) = cross(tmp_path)
    assert (f.kind, f.rank, f.step) == ("hang", None, 150)
    assert f.summary.startswith("All 4 ranks stopped in step 150's backward")


def test_a_rank_that_died_while_the_others_waited_is_the_one_named(tmp_path):
    bs = [rank(r, steps=150) for r in range(RANKS)]
    bs[2] = rank(2, steps=120).attrs(closed=True, end_reason="exception: RuntimeError: CUDA error")
    for r in (0, 1, 3):
        _stall(bs[r], 150, "backward", 64, "loss.backward()")
    write(tmp_path, bs)
    hang = [f for f in cross(tmp_path) if f.kind == "hang"]
    assert [(f.rank, f.step) for f in hang] == [(2, 120)]
    assert "CUDA error" in hang[0].summary


def test_a_slow_healthy_job_without_a_stall_is_not_a_hang(tmp_path):
    bs = [rank(r, steps=150) for r in range(RANKS)]
    # A heartbeat row at step 0 (the first step's compile) that the job got past, then killed by
    # its time limit while steps came: no stall.
    bs[0].heartbeats([{"time_unix": 1.0, "step": 0, "phase": "forward", "phase_s": 6.0, "step_s": 6.0,
                       "typical_step_s": float("nan"), "stack": ""}])
    write(tmp_path, [b.attrs(closed=False, end_reason="") for b in bs])
    assert cross(tmp_path) == []


def test_one_rank_alone_that_hung_is_a_hang_of_rank_0(tmp_path):
    _stall(rank(0, steps=150).attrs(world_size=1), 150, "forward", 70, "out = model(x)").write(tmp_path)
    (f,) = cross(tmp_path)
    assert (f.kind, f.rank, f.step, f.evidence["at"]) == ("hang", 0, 150, "train.py:70")
    assert f.summary.startswith("Rank 0 stopped in step 150's forward, at train.py:70 (`out = model(x)`)")


def test_the_same_finding_on_every_rank_is_one_finding_with_the_ranks_listed(tmp_path):
    bs = [rank(r) for r in range(RANKS)]
    for b in bs:  # gradients explode on every rank at once (they are all-reduced)
        b.total_grad_norm(1e6, at=slice(150, None))
    write(tmp_path, bs)
    boom = findings(tmp_path, "exploding_gradients")
    assert len(boom) == 1 and boom[0].rank == 0 and boom[0].evidence["ranks"] == [0, 1, 2, 3]
    assert "[all 4 ranks; rank 0 first]" in boom[0].summary


def test_rank_sets_read_as_ranges():
    assert rank_set([r for r in range(64) if r != 5], range(64)) == "ranks 0-63 except 5"
    assert rank_set([1, 3, 4, 5], range(8)) == "ranks 1, 3-5"
    assert rank_set(range(64), range(64)) == "all 64 ranks"
    assert rank_set([0, 1], [0, 1, 2]) == "ranks 0-1"
    assert rank_set([7], range(8)) == "rank 7"


def test_all_ranks_at_once_the_rank_whose_own_batch_went_wrong_is_named_first(tmp_path):
    bs = [rank(r) for r in range(RANKS)]
    for b in bs:  # all-reduced: every rank's gradients explode at step 150 ...
        b.total_grad_norm(1e6, at=slice(150, None))
    bs[2].loss(40.0, at=150)  # ... from rank 2's batch: its own loss jumped there
    write(tmp_path, bs)
    (boom,) = findings(tmp_path, "exploding_gradients")
    assert boom.rank == 2 and boom.evidence["ranks"] == [0, 1, 2, 3]
    assert "rank 2's own loss there was 40" in boom.evidence["local_first"]


def test_out_of_memory_on_one_rank_says_how_close_the_others_came(tmp_path):
    from torchautopsy.analyzer.cross_rank.digest import digest_of
    from torchautopsy.analyzer.cross_rank.memory import others_memory
    from torchautopsy.analyzer.findings import Finding
    from torchautopsy.analyzer.trace import load

    bs = [rank(r) for r in range(RANKS)]
    for r, b in enumerate(bs):
        b.set("steps/rss_bytes", np.int64((8 + r) * 2**30))  # rank 3 the largest: 11 GiB; rank 2: 10
    write(tmp_path, bs)
    trace = load(tmp_path)
    digests = {r: digest_of(rt) for r, rt in trace.ranks.items()}
    f = others_memory(Finding("out_of_memory", "error", 100, [], "Rank 3 ran out of memory.", rank=3), digests)
    assert f.evidence["others_memory"] == {"measure": "rss", "min_share": 8 / 11, "max_share": 10 / 11,
                                           "closest_rank": 2}
    assert "peaked at 73-91% of rank 3's (closest: rank 2)" in f.summary


def test_hostile_heartbeats_and_fingerprints_are_data_not_a_crash(tmp_path):
    """Rows no recorder writes (times and steps past any clock, a stack that is not one, JSON
    nested 5,000 deep, fingerprints of the wrong width): the real CLI (in this process, torch hidden)
    reads on, no traceback."""
    import h5py

    from tests.helpers import invoke_cli

    for r in range(2):
        b = rank(r, steps=30).attrs(world_size=2, closed=False, end_reason="")
        b.heartbeats([{"time_unix": 1e300, "step": 2**62, "phase": "forward", "phase_s": float("inf"),
                       "step_s": 1e30, "typical_step_s": -5.0, "stack": '[["a", 1, "b", "c"], 5, null]'},
                      {"time_unix": float("nan"), "step": 31, "phase": "data", "phase_s": 1, "step_s": 1e9,
                       "typical_step_s": 0.1, "stack": "[" * 5000},
                      {"time_unix": 1e12, "step": 30, "phase": "backward", "phase_s": 1e9, "step_s": 1e9,
                       "typical_step_s": 0.1, "stack": '[["x' + "\u202e" * 100 + '", -1, "y", "z"]]'}])
        b.write(tmp_path, rank=r)
    with h5py.File(tmp_path / "rank1.h5", "a") as f:
        del f["fingerprints/bits"]
        f["fingerprints/bits"] = np.zeros((3, 2), dtype=np.int64)
    r = invoke_cli("analyze", tmp_path, "--json", tmp_path / "f.json", "--html", tmp_path / "r.html", block_torch=True)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    import json
    kinds = [f["kind"] for f in json.loads((tmp_path / "f.json").read_text())["findings"]]
    assert "analyzer_error" not in kinds and "hang" in kinds  # (the last row: both ranks stalled in step 30)


def test_ranks_that_agreed_then_all_split_apart_are_a_warning_not_a_named_rank(tmp_path):
    bs = [rank(r) for r in range(RANKS)]
    for r, b in enumerate(bs):  # local SGD, or a per-rank seed in the update: every rank its own from step 50
        for row in b.rows["fingerprints"][5:]:
            row["bits"] = row["bits"] + r
    write(tmp_path, bs)
    (f,) = cross(tmp_path)
    assert (f.kind, f.severity, f.rank, f.step) == ("replica_divergence", "warning", None, 50)
