"""The cross-rank counters (analyzer/cross_rank/counters.py): merged in any tree shape and any
order of the ranks they equal the ranks merged one by one, hold exactly which rank holds which
fingerprint (or none, at a step it did not record) and stood where (against a plain count of the rows), and give the replica and hang
detectors the same findings whatever the tree. Random ranks: some not replicas, some missing
fingerprint steps, values that split with and without a majority, positions of every kind."""

from __future__ import annotations

import random
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from torchautopsy.analyzer.cross_rank import counters, divergence, hang

PHASES = ["between_steps", "data", "forward", "backward", "recorder", ""]
HANG = hang.HangConfig()


def _rank(r: int, rng: random.Random, skew: float) -> SimpleNamespace:
    """A digest-like rank: what counters.leaf reads (a RankDigest's or a Light's fields)."""
    fp_steps = np.arange(0, 2000, 100, dtype=np.int64)
    if rng.random() < 0.1:  # (a rank whose fingerprints stop early)
        fp_steps = fp_steps[:rng.randint(5, 19)]
    fp_hash = np.array([7 if k < 3 or rng.random() < skew else rng.randint(1, 4) for k in range(len(fp_steps))],
                       dtype=np.int64)
    last = rng.choice([95, 99, 99, -1, None])
    beats = []
    if rng.random() < 0.8:
        at = (last if last is not None else -1) + rng.choice([0, 1, 1])
        beats = [{"time_unix": 100.0 + i, "step": int(at), "phase": rng.choice(PHASES), "phase_s": 1.0,
                  "step_s": rng.choice([0.5, 5.0, 50.0]), "typical_step_s": rng.choice([0.3, float("nan")])}
                 for i in range(rng.randint(1, 3))]
    return SimpleNamespace(
        rank=r, replicated=rng.random() < 0.95, fp_steps=fp_steps, fp_hash=fp_hash, param_names=["w", "b"],
        heartbeats=beats, last_stack=[("/job/train.py", rng.choice([61, 64]), "main", "x = f()")],
        last_stack_step=beats[-1]["step"] if beats else None, end_reason=rng.choice(["", "exception: X"]),
        last_step=last, heartbeat_s=1.0 if beats or rng.random() < 0.5 else 0.0,
        nccl_env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"} if rng.random() < 0.05 else {})


def _view(c: counters.Counts) -> dict:
    """Everything a Counts says, each value's ranks listed (however the tally stores them)."""
    fp, pos = c.fingerprints, c.positions

    def tally(t):
        return {v: (t.count[v], t.first[v], t.ranks_of(v).tolist()) for v in t.count}

    return {"members": fp.members.tolist(), "names": fp.names, "mixed": fp.mixed,
            "steps": None if fp.steps is None else fp.steps.tolist(), "at": [tally(t) for t in fp.at],
            "positions": tally(pos.tally), "rep": repr(sorted(pos.rep.items())), "stalled": pos.stalled,
            "nccl": pos.nccl, "listed": [sorted(t.listed) for t in fp.at] + [sorted(pos.tally.listed)]}


def _random_tree(parts: list, rng: random.Random):
    """The parts merged in a random shape: random groups of random sizes, level by level."""
    while len(parts) > 1:
        rng.shuffle(parts)
        out, i = [], 0
        while i < len(parts):
            k = rng.randint(1, 5)
            out.append(counters.merged(parts[i:i + k]) if k > 1 else parts[i])
            i += k
        parts = out
    return parts[0]


def _rows(ranks: dict) -> dict:
    """The plain count: at each fingerprint step any replica recorded, the ranks of each hash
    (ABSENT: the replicas that did not record it); each position's ranks."""
    reps = {r: d for r, d in ranks.items() if d.replicated and len(d.fp_steps)}
    steps = np.unique(np.concatenate([d.fp_steps for d in reps.values()])) if reps else []
    at = []
    for s in steps:
        held = defaultdict(list)
        for r, d in sorted(reps.items()):
            i = np.searchsorted(d.fp_steps, s)
            held[int(d.fp_hash[i]) if i < len(d.fp_steps) and d.fp_steps[i] == s else counters.ABSENT].append(r)
        at.append({v: (len(rs), rs[0], rs) for v, rs in held.items()})
    where = defaultdict(list)
    for r, d in sorted(ranks.items()):
        state = hang.where_stopped(d, HANG)
        if d.heartbeat_s > 0 or state is not None:
            where[hang.place(state, d.last_step)].append(r)
    return {"at": at, "positions": {k: (len(rs), rs[0], rs) for k, rs in where.items()}}


@pytest.mark.parametrize("seed", range(12))
def test_counters_merged_in_any_tree_equal_the_serial_merge_and_the_plain_count(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 7, 33, 130])
    ranks = {r: _rank(r, rng, skew=rng.choice([0.3, 0.7, 0.97, 1.0])) for r in range(n)}
    leaves = {r: counters.leaf([d], HANG) for r, d in ranks.items()}
    serial = leaves[0]
    for r in range(1, n):
        serial = counters.merged([serial, leaves[r]])
    want = _view(serial)
    plain = _rows(ranks)
    assert want["at"] == plain["at"] and want["positions"] == plain["positions"]
    for fan in (2, 3, 8):
        assert _view(counters.tree(list(leaves.values()), fan)) == want
    for group in (2, 5, 32):  # (leaves of several ranks, as the Dask tree's tasks make them)
        assert _view(counters.of(ranks, HANG, group)) == want
    for _ in range(4):
        tree = _random_tree(list(leaves.values()), rng)
        assert _view(tree) == want
        for det, cfg in ((hang, HANG), (divergence, divergence.ReplicaDivergenceConfig())):
            found = [f.to_dict() for f in det.detect(ranks, cfg, counts=tree)]
            assert repr(found) == repr([f.to_dict() for f in det.detect(ranks, cfg, counts=serial)])


def test_a_tally_lists_the_odd_ranks_only():
    """4,096 replicas, two of which left the others at the last step: the merged tally lists
    those two (and nothing for the majority, whose ranks are the ones not listed)."""
    leaves = [counters.leaf([SimpleNamespace(
        rank=r, replicated=True, fp_steps=np.array([0, 100]), fp_hash=np.array([5, 9 if r in (17, 3000) else 5]),
        param_names=["w"], heartbeats=[], last_stack=None, last_stack_step=None, end_reason="", last_step=100,
        heartbeat_s=0.0, nccl_env={})], HANG) for r in range(4096)]
    c = counters.tree(leaves)
    last = c.fingerprints.at[1]
    assert last.count == {5: 4094, 9: 2} and {v: a.tolist() for v, a in last.listed.items()} == {9: [17, 3000]}
    assert c.fingerprints.at[0].listed == {} and len(last.ranks_of(5)) == 4094
    found = divergence.detect({}, divergence.ReplicaDivergenceConfig(), counts=c)
    assert [(f.rank, f.step, f.evidence["majority_ranks"]) for f in found] == [(17, 100, 4094), (3000, 100, 4094)]


def test_the_counters_made_in_this_process_from_lights_read_the_files_again(tmp_path):
    """A Light keeps no fingerprint or heartbeat: where the Dask tree failed, analyze counts the
    ranks whose Lights came back from their files read again here; the counts equal those of the
    full digests (the local path). Real rank files: a replica that left, a rank that stopped
    early (fewer fingerprints), a hang."""
    from tests.analyzer.detectors.test_cross_rank import _stall, rank
    from torchautopsy.analyzer.config import AnalysisConfig
    from torchautopsy.analyzer.cross_rank.digest import digest_of
    from torchautopsy.analyzer.cross_rank.light import light
    from torchautopsy.analyzer.run import _counted
    from torchautopsy.analyzer.trace import load

    bs = [rank(r, steps=150) for r in range(5)]
    bs[4] = rank(4, steps=120).attrs(closed=True, end_reason="exception: RuntimeError: CUDA error")
    for row in bs[2].rows["fingerprints"][7:]:
        row["bits"] = row["bits"].copy()
        row["bits"][1] += 1
    for r in range(4):
        _stall(bs[r], 150, "data" if r == 1 else "backward", 61, "x = f()")
    for r, b in enumerate(bs):
        b.write(tmp_path, rank=r)
    trace = load(str(tmp_path))
    full = {r: ([], digest_of(rt)) for r, rt in trace.ranks.items()}
    want = _view(counters.of({r: d for r, (_, d) in full.items()}, HANG))
    assert _view(_counted(trace, full, AnalysisConfig())) == want
    lights = {r: ([], light(d)) for r, (_, d) in full.items()}
    assert not hasattr(lights[0][1], "fp_hash") and not hasattr(lights[0][1], "heartbeats")
    assert _view(_counted(trace, lights, AnalysisConfig())) == want
    fp = counters.of({r: d for r, (_, d) in full.items()}, HANG).fingerprints
    assert fp.steps[-1] == 140 and fp.at[-1].ranks_of(counters.ABSENT).tolist() == [4] and fp.steps[fp.full()][-1] == 110
    (f,) = divergence.detect({}, divergence.ReplicaDivergenceConfig(), counts=_counted(trace, lights, AnalysisConfig()))
    assert (f.rank, f.step, f.evidence["last_agreed_step"], f.evidence["majority_ranks"]) == (2, 70, 60, 4)
