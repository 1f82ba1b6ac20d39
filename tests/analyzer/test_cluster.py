"""The per-rank pass on a Dask cluster (analyzer/cluster.py, ``--scheduler``): a real 2-worker
LocalCluster (worker processes, 1 GiB each) gives the findings the local path gives on the
many-rank cases of the suite (tests/analyzer/detectors/test_cross_rank.py's planted runs, the
DDP samples, the many_ranks benchmark's run in small, copies of one rank); a rank whose task
fails, or whose worker dies each time it runs it, is that rank's "could not read" finding."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from tests.analyzer.detectors.test_cross_rank import RANKS, _stall, rank
from tests.helpers import SAMPLES, rank_copies

pytestmark = pytest.mark.slow  # (a cluster's worker processes start in ~6-10 s on two cores)


@pytest.fixture(scope="module")
def client():
    import dask
    from distributed import Client, LocalCluster

    # A task whose worker dies is given up at once (Dask's default retries it 3 times, on fresh workers).
    # (workers that may start the files' probe children, as analyze's local:N starts them; without
    # the profiler that samples their threads every 10 ms for a dashboard no test reads)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0, "distributed.worker.daemon": False,
                          "distributed.worker.profile.enabled": False}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit="1GiB",
                         dashboard_address=None, silence_logs=logging.CRITICAL) as cluster, Client(cluster) as c:
        yield c


def _straggler(d):
    bs = [rank(r) for r in range(RANKS)]
    bs[3].set("steps/forward_s", 0.08, at=slice(120, None))
    for b in bs[:3]:
        b.set("steps/backward_s", b.cols["steps/backward_s"] + np.where(b.steps >= 120, 0.05, 0))
    return bs


def _diverged(d):
    bs = [rank(r) for r in range(RANKS)]
    for row in bs[2].rows["fingerprints"][7:]:
        row["bits"] = row["bits"].copy()
        row["bits"][1] += 1
    return bs


def _hang(d):
    bs = [rank(r, steps=150) for r in range(RANKS)]
    _stall(bs[1], 150, "data", 61, "batch = next(it)")
    for r in (0, 2, 3):
        _stall(bs[r], 150, "backward", 64, "loss.backward()")
    return bs


def _died(d):
    bs = [rank(r, steps=150) for r in range(RANKS)]
    bs[2] = rank(2, steps=120).attrs(closed=True, end_reason="exception: RuntimeError: CUDA error")
    for r in (0, 1, 3):
        _stall(bs[r], 150, "backward", 64, "loss.backward()")
    return bs


def _exploded(d):
    bs = [rank(r) for r in range(RANKS)]
    for b in bs:
        b.total_grad_norm(1e6, at=slice(150, None))
    bs[2].loss(40.0, at=150)
    return bs


def _split(d):
    bs = [rank(r) for r in range(RANKS)]
    for r, b in enumerate(bs):
        for row in b.rows["fingerprints"][5:]:
            row["bits"] = row["bits"] + r
    return bs


def _oom(d):
    """Rank 3 runs out of (resident) memory at step 100; the others came to 73-91% of it: the
    Dask path asks each rank's peak up to that step where the rank is read."""
    bs = [rank(r) for r in range(RANKS)]
    for r, b in enumerate(bs):
        b.set("steps/rss_bytes", np.int64((8 + r) * 2**30))
    bs[3].row("oom_events", step=100, time_s=1.0, source="exception", device="cpu", requested_bytes=2**30,
              device_allocated_bytes=-1, device_reserved_bytes=-1, device_free_bytes=-1, device_total_bytes=-1,
              rss_bytes=11 * 2**30, snapshot=-1, message="DefaultCPUAllocator: can't allocate memory",
              raised_at="/job/train.py:64 in main")
    return bs


BUILT = {"oom": _oom, "straggler": _straggler, "diverged": _diverged, "hang": _hang, "died": _died, "exploded": _exploded,
         "split": _split, "healthy": lambda d: [rank(r) for r in range(RANKS)]}


def _run_dir(case: str, tmp_path):
    """The run directory of a case: written here, or a sample's."""
    if case in BUILT:
        for r, b in enumerate(BUILT[case](tmp_path)):
            b.write(tmp_path, rank=r)
        return tmp_path
    if case == "many_ranks":  # (the benchmark's run: a straggler, a diverged replica, a hang; 8 ranks)
        from benchmarks.many_ranks import write_run

        write_run(tmp_path, ranks=8, steps=400, params=30, workers=1)
        return tmp_path
    if case == "copies":
        return rank_copies(tmp_path / "run", 4)
    return SAMPLES / case


_COMPARED: dict[str, tuple[list[dict], list[dict]]] = {}  # case -> (local, on Dask): each analyzed once


def _compared(case: str, client, tmp_path) -> tuple[list[dict], list[dict]]:
    """A case's findings on the local path and on the cluster."""
    if case not in _COMPARED:
        run_dir = _run_dir(case, tmp_path)
        _COMPARED[case] = _findings(run_dir, workers=1), _findings(run_dir, scheduler=client)
    return _COMPARED[case]


def _findings(run_dir, **how) -> list[dict]:
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.analyzer.trace import load

    return sorted((f.to_dict() for f in analyze(load(str(run_dir)), **how)),
                  key=lambda f: (f["kind"], str(f["rank"]), str(f["step"]), f["summary"]))


@pytest.mark.parametrize("case", [*BUILT, "many_ranks", "copies", "ddp_straggler", "ddp_hang"])
def test_the_cluster_finds_what_the_local_path_finds(client, case, tmp_path):
    local, on_dask = _compared(case, client, tmp_path)
    assert on_dask == local
    assert case in ("healthy", "copies") or any(f["severity"] != "info" for f in local)  # (a case that shows something)


def test_the_sketch_tree_of_several_levels_finds_the_straggler_the_local_path_finds(client, tmp_path, monkeypatch):
    """Ranks sketched two a task and merged two at a time (5 ranks: leaves of 2, 2 and 1, merged
    3 -> 2 -> 1, a tree of three levels with an uneven group at each): the same findings as
    sorting every rank's values in one process."""
    from torchautopsy.analyzer import cluster_passes

    monkeypatch.setattr(cluster_passes, "LEAF", 2)
    monkeypatch.setattr(cluster_passes, "FAN", 2)
    bs = [rank(r).attrs(world_size=5) for r in range(5)]
    bs[4].set("steps/forward_s", 0.08, at=slice(120, None))
    for r, b in enumerate(bs):
        b.write(tmp_path, rank=r)
    local = _findings(tmp_path, workers=1)
    assert [(f["rank"], f["step"]) for f in local if f["kind"] == "straggler"] == [(4, 120)]
    assert _findings(tmp_path, scheduler=client) == local


def test_the_oom_case_tells_how_close_the_other_ranks_came_on_both_paths(client, tmp_path):
    for found in _compared("oom", client, tmp_path):
        (oom,) = [f for f in found if f["kind"] == "out_of_memory"]
        assert oom["rank"] == 3 and oom["evidence"]["others_memory"]["closest_rank"] == 2


def _fails_on_rank_2(trace, r, cfg=None):
    """A rank pass that raises on rank 2 (as a damaged file's read would), else the real one."""
    from torchautopsy.analyzer.run import rank_pass

    if r == 2:
        raise ValueError("a damaged table")
    return rank_pass(trace, r, cfg)


def _kills_its_worker_on_rank_2(trace, r, cfg=None):
    """A rank pass whose process dies on rank 2 (the OOM killer, a segfault in a library)."""
    from torchautopsy.analyzer.run import rank_pass

    if r == 2:
        os._exit(9)
    return rank_pass(trace, r, cfg)


@pytest.mark.parametrize("rank_pass, why", [(_fails_on_rank_2, "reading it failed: ValueError: a damaged table"),
                                            (_kills_its_worker_on_rank_2, "the worker reading it died")])
def test_a_rank_whose_task_fails_is_that_ranks_could_not_read_finding(client, tmp_path, rank_pass, why):
    from torchautopsy.analyzer import cluster
    from torchautopsy.analyzer.config import AnalysisConfig
    from torchautopsy.analyzer.trace import load

    trace = load(str(_run_dir("healthy", tmp_path)))
    seen = []
    results = cluster.per_rank(trace, lambda t, r: rank_pass(t, r, AnalysisConfig()), client,
                               progress=lambda done, total: seen.append((done, total)))
    assert sorted(results) == [0, 1, 2, 3] and seen[-1] == (4, 4)
    (lost,), digest = results[2]
    assert digest is None and (lost.kind, lost.rank, lost.severity) == ("unreadable_rank", 2, "warning")
    assert why in lost.summary and lost.evidence["file"].endswith("rank2.h5")
    assert all(d is not None and not any(f.kind == "unreadable_rank" for f in found)
               for r, (found, d) in results.items() if r != 2)


def test_the_workers_decode_the_files_first_and_this_process_trusts_what_they_checked(client, tmp_path):
    """load(prober=cluster.prober(client)): the probe children are the workers' (issue 41, 3),
    a file HDF5 would decode forever (tests/cli/test_bad_input.py's) is that file's "could not
    read" after the deadline, and this process opens the others without walking them again."""
    from torchautopsy.analyzer import cluster
    from torchautopsy.analyzer.trace import load, safety

    for r in range(3):
        rank(r).write(tmp_path, rank=r)
    data = bytearray((SAMPLES / "exploding_cnn" / "rank0.h5").read_bytes())
    data[706325:706325 + 512] = bytes(512)
    (tmp_path / "rank3.h5").write_bytes(bytes(data))
    client.run(lambda: os.environ.__setitem__("TORCHAUTOPSY_READ_DEADLINE_S", "3"))
    try:
        told = []
        trace = load(str(tmp_path), prober=cluster.prober(client),
                     progress=lambda done, total, what: told.append(what))
    finally:
        client.run(lambda: os.environ.pop("TORCHAUTOPSY_READ_DEADLINE_S", None))
    assert sorted(trace.ranks) == [0, 1, 2]
    (path, why), = trace.unreadable.items()
    assert path.endswith("rank3.h5") and "did not finish within 3 s" in why
    assert all(safety.path_identity(str(tmp_path / f"rank{r}.h5")) is not None for r in range(3))
    assert "rank files checked: 4 of 4" in told
