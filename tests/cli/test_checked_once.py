"""Each rank file is walked for safety once per command, and opened a few times, not ~80 (issue 38,
point 4: 10,000 small rank files took ~2.5 hours, each walked three times and, by ``info``,
reopened for every table it read).

The deadline probe's child walks each file once (safety.py's check, decoding as it goes) and
tells this process the identity of the files it passed; this process and the workers of
``analyze`` open them without walking them again, and each keeps a rank's file open while it
reads it. Counted, not timed: a sitecustomize on PYTHONPATH counts every walk and every open in
every process of a real CLI run (the probe's forked children, the parent, the spawned workers).
"""

from __future__ import annotations

import collections

import pytest

from tests.helpers import rank_copies, run_cli

# Enough files that each opened once more than its bound, or once per other rank, breaks the bounds
# below (the sum's slack is 4 opens); more only cost each file's walk and pass (~0.25 CPU-s a file).
N_RANKS = 12

COUNTER = '''
import os
import sys
from torchautopsy.analyzer import parallel
from torchautopsy.analyzer.trace import format, safety

_run, _open = safety._Walk.run, format._open


def _log(what, path):
    with open(os.environ["TORCHAUTOPSY_TEST_COUNT"], "a") as f:
        f.write(f"{what} {os.path.basename(path)}\\n")


def run(self, f):
    _log("walk-decoding" if self.decode else "walk", self.path)
    return _run(self, f)


def counted_open(path):
    _log("open", path)
    return _open(path)


safety._Walk.run = run
parallel.WORKERS_FROM_BYTES = 0  # (these files are small: the workers' opens are counted too)
for module in list(sys.modules.values()):  # (every module that imported format._open)
    if getattr(module, "__name__", "").startswith("torchautopsy") and getattr(module, "_open", None) is _open:
        module._open = counted_open
'''


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    return rank_copies(tmp_path_factory.mktemp("many") / "run", N_RANKS)


def _counts(log) -> dict[str, collections.Counter]:
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in log.read_text().splitlines():
        what, name = line.split()
        out[what][name] += 1
    return out


@pytest.mark.parametrize("command", ["analyze", "info"])
def test_each_rank_file_is_walked_once_and_opened_a_few_times(many, tmp_path, monkeypatch, command):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("TORCHAUTOPSY_TEST_COUNT", str(tmp_path / "count.log"))
    args = [command, many] + (["--json", tmp_path / "f.json"] if command == "analyze" else [])
    r = run_cli(*args, timeout=600)
    assert r.returncode == 0, r.stderr
    counts = _counts(tmp_path / "count.log")
    names = {f"rank{k}.h5" for k in range(N_RANKS)}
    # One walk a file, in the probe's child (checking and decoding); none in this process or a worker.
    assert counts["walk-decoding"] == {n: 1 for n in names}
    assert counts["walk"] == {}
    # Opened by the probe's child, by load() here, then for the paragraph (info), or in the worker
    # (load, then the rank's pass on one open) and here for the black box line (analyze): 3 or 5
    # times (the first rank a few more: the run's line), where info opened each ~80 times and
    # analyze's pass ~200.
    bound = 3 if command == "info" else 5
    assert set(counts["open"]) == names
    assert max(counts["open"].values()) <= bound + 2, counts["open"]
    assert sum(counts["open"].values()) <= bound * N_RANKS + 4, counts["open"]
