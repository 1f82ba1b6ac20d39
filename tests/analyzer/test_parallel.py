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
