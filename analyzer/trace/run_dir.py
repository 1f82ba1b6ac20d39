"""A run directory: every rank's trace."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import SchemaVersionError, TraceFormatError, TraceNotFoundError
from . import shards
from .attempts import Attempt, group, parse_name
from .format import STARTING_SUFFIX
from .probe import damaged
from .rank import RankTrace

Progress = Callable[[int, int, str], None]
# Files decoded by one probing child before the progress moves (one fork a batch: ~1 ms).
PROBE_BATCH = 64


class Trace:
    """A run directory: every rank's trace, keyed by rank. A rank whose job was restarted into
    the directory has a file per attempt: ``ranks[r]`` is their timeline (attempts.py),
    ``attempts[r]`` each attempt's own trace, ``notes`` (kind, line) of what does not fit."""

    def __init__(self, run_dir: str, ranks: dict[int, RankTrace], unreadable: dict[str, str],
                 attempts: dict[int, list[Attempt]] | None = None, notes: list[tuple[str, str]] | None = None):
        self.run_dir = run_dir
        self.ranks = dict(sorted(ranks.items()))
        self.unreadable = unreadable  # file -> reason, for ranks that could not be read
        self.attempts = attempts if attempts is not None else {r: [Attempt(1, rt, rt.n_steps)]
                                                               for r, rt in self.ranks.items()}
        self.notes = list(notes or [])
        # rank -> its Light (analyzer/cross_rank/light.py), and the ranks' merged counters
        # (cross_rank/counters.py), set by the analysis
        self.digests: dict | None = None
        self.counts = None

    @property
    def size_bytes(self) -> int:
        return sum(a.trace.size_bytes for attempts in self.attempts.values() for a in attempts)

    @property
    def n_files(self) -> int:
        return sum(len(attempts) for attempts in self.attempts.values())

    def __repr__(self) -> str:
        return f"Trace({self.run_dir!r}, ranks={list(self.ranks)})"


def trace_files(path: str) -> list[str]:
    """The rank files of a run directory (or the one file given)."""
    if not os.path.exists(path):
        raise TraceNotFoundError(f"{path} does not exist; give the run directory passed to "
                                 "Recorder(model, run_dir)")
    if not os.path.isdir(path):
        return [path]  # (one file given: RankTrace refuses what is not a regular file)
    files = [os.path.join(path, n) for n in os.listdir(path) if parse_name(n) is not None]
    if not files:
        started = _died_starting(path)
        if started:
            raise TraceNotFoundError(f"{path}: {started[min(started)]}")
        raise TraceNotFoundError(f"{path} holds no rank*.h5 trace files; give the run directory "
                                 "passed to Recorder(model, run_dir)")
    return sorted(files, key=parse_name)  # by rank, then attempt


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _died_starting(path: str) -> dict[str, str]:
    """{file name: reason} for ranks (or attempts) whose job ended before its first flush: the
    recorder builds rank{N}.h5 (rank{N}.attempt{K}.h5) as <name>.starting and renames it once
    it is readable."""
    if not os.path.isdir(path):
        return {}
    names = set(os.listdir(path))
    return {n: f"{n}: the job ended before its first data was flushed (within a moment of "
               "Recorder()), so this " + ("attempt" if ".attempt" in n else "rank") + " recorded nothing"
            for n in names if n.endswith(STARTING_SUFFIX) and parse_name(n[:-len(STARTING_SUFFIX)])
            and n[:-len(STARTING_SUFFIX)] not in names}


def probe_here(files: list[str], sizes: list[int], told) -> dict[str, str]:
    """The files decoded in probe children of this process, PROBE_BATCH at a time: {path: why} of the damaged."""
    bad: dict[str, str] = {}
    for start in range(0, len(files), PROBE_BATCH):
        bad.update(damaged(files[start:start + PROBE_BATCH], sizes[start:start + PROBE_BATCH]))
        told(min(start + PROBE_BATCH, len(files)))
    return bad


def load(run_dir, progress: Progress | None = None, prober=None) -> Trace:
    """Open a run directory (or one rank file) for reading.

    Raises a TraceError subclass with a one-line reason if nothing in it can be analyzed; a
    multi-rank run with some unreadable files loads the readable ones and lists the others in
    ``Trace.unreadable``. ``progress(done, total, what)`` is told as the files are checked and
    opened (a run of thousands of ranks takes a while: the CLI shows a bar). ``prober(files,
    sizes, told)``: decodes the files first instead of this machine's probe children (on a Dask
    cluster: analyzer/cluster.py's prober), returns {path: why} of the damaged ones and trusts
    those it checked; ``told(done)`` as it goes.
    """
    run_dir = os.fspath(run_dir)
    return load_files(run_dir, trace_files(run_dir), progress=progress, prober=prober)


def load_files(run_dir: str, files: list[str], died_starting: bool = True, probed: bool = False,
               progress: Progress | None = None, prober=None) -> Trace:
    """load() of these rank files of ``run_dir`` (a worker reads one rank's: analyzer/parallel.py),
    each decoded first in a child process with a deadline (probe.py) unless ``probed`` already.
    The work is two passes over the files, each a fixed cost a file: decoding (probe.py) and
    opening (RankTrace reads the names and checks the tables); ``progress`` is told of both."""
    n = len(files)
    traces: list[RankTrace] = []
    unreadable: dict[str, str] = {}
    if progress and not probed:
        progress(0, 2 * n, f"rank files checked: 0 of {n:,}")
    if not probed:
        told = (lambda done: progress(done, 2 * n, f"rank files checked: {done:,} of {n:,}")) if progress else \
            (lambda done: None)
        unreadable.update((prober or probe_here)(files, [_size(p) for p in files], told))
    first_error = TraceFormatError(next(iter(unreadable.values()))) if unreadable else None
    for i, p in enumerate(files):
        if progress:
            progress(n + i, 2 * n, f"rank files opened: {i:,} of {n:,}")
        if p in unreadable:
            continue
        try:
            traces.append(RankTrace(p))
        except (TraceFormatError, SchemaVersionError) as e:
            first_error = first_error or e
            unreadable[p] = str(e)
    if not traces:
        raise first_error
    if died_starting:
        unreadable.update({os.path.join(run_dir, n): why for n, why in _died_starting(run_dir).items()})
    ranks, attempts, notes = group(traces)
    return Trace(run_dir, shards.combine(ranks), unreadable, attempts, notes)
