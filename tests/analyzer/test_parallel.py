"""The per-rank pass in worker processes (analyzer/parallel.py): the same findings as in one
process, and when workers cannot run (here: a script read from stdin, whose __main__ a spawned
worker cannot import, so the worker dies at start) the ranks are read in this process instead."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import SAMPLES

SCRIPT = f"""
from torchautopsy.analyzer.run import analyze
from torchautopsy.analyzer.trace import load
run = load({str(SAMPLES / "ddp_straggler")!r})
found = analyze(run, workers=2)
print(sorted((f.kind, f.rank, f.step) for f in found if f.severity != "info"))
"""


def _serious(trace_dir, workers):
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.analyzer.trace import load

    return sorted((f.kind, f.rank, f.step, f.summary) for f in analyze(load(trace_dir), workers=workers))


def test_workers_find_what_one_process_finds():
    case = SAMPLES / "ddp_straggler"
    assert _serious(case, 2) == _serious(case, 1)


def test_workers_that_cannot_start_leave_the_ranks_to_this_process():
    r = subprocess.run([sys.executable, "-"], input=SCRIPT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FileNotFoundError" in r.stderr  # (the spawned worker's own death, before any rank)
    assert r.stdout.strip() == "[('dataloader_bottleneck', 1, 64), ('straggler', 1, 60)]", r.stdout


def _damaged_after_opening(tmp_path, ranks):
    """A run whose rank 1 (or only rank) holds strings in steps/rss_bytes: the file opens and
    lists its tables; the memory detectors' read finds it damaged."""
    import h5py

    from tests.tracebuilder import TraceBuilder

    for r in range(ranks):
        TraceBuilder.mlp(layers=3, steps=40, rank=r, world_size=ranks).loss(1.0).total_grad_norm(1.0).write(tmp_path)
    with h5py.File(tmp_path / f"rank{min(1, ranks - 1)}.h5", "r+") as f:
        data = f["steps/rss_bytes"][()]
        del f["steps/rss_bytes"]
        f.create_dataset("steps/rss_bytes", data=data.astype("S8"), maxshape=(None,), chunks=True)


def test_a_rank_file_found_damaged_by_a_detector_is_that_ranks_problem(tmp_path):
    """Issue 38 (4): the local path as the Dask path: a rank file found unusable after it was
    opened is that rank's "could not read", the other ranks analyzed, in workers and in one process."""
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.analyzer.trace import load

    _damaged_after_opening(tmp_path, 3)
    for workers in (2, 1):
        found = analyze(load(str(tmp_path)), workers=workers)
        bad = [f for f in found if f.kind == "unreadable_rank"]
        assert [(f.rank, f.evidence["file"]) for f in bad] == [(1, str(tmp_path / "rank1.h5"))], found
        assert bad[0].summary == f"{tmp_path / 'rank1.h5'}: steps/rss_bytes holds |S8, not numbers; the trace is damaged"
        assert set(load(str(tmp_path)).ranks) == {0, 1, 2}


def test_the_only_rank_found_damaged_stops_the_analysis_in_one_line(tmp_path):
    import pytest

    from torchautopsy.analyzer.errors import TraceError
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.analyzer.trace import load

    _damaged_after_opening(tmp_path, 1)
    with pytest.raises(TraceError, match="steps/rss_bytes holds"):
        analyze(load(str(tmp_path)), workers=2)


def test_workers_start_only_for_files_big_enough_to_repay_them():
    """A spawned worker costs ~1.5 CPU-s before it reads anything: a 4-rank sample (5.5 MB) took
    4.6 CPU-s in workers and 2.3 in one process, so the CLI starts them from WORKERS_FROM_BYTES."""
    from torchautopsy.analyzer import parallel
    from torchautopsy.analyzer.trace import load

    run = load(str(SAMPLES / "ddp_hang"))
    size = parallel.files_bytes(run)
    assert size == sum(os.path.getsize(p) for p in (SAMPLES / "ddp_hang").glob("*.h5"))
    assert parallel.workers_for(len(run.attempts), size) == 1
    assert parallel.workers_for(4, parallel.WORKERS_FROM_BYTES) == min(4, len(os.sched_getaffinity(0)))
    assert parallel.workers_for(1, parallel.WORKERS_FROM_BYTES) == 1
