"""A run directory: every rank's trace."""

from __future__ import annotations

import os

from ..errors import SchemaVersionError, TraceFormatError, TraceNotFoundError
from .format import _RANK_FILE, STARTING_SUFFIX, rank_of_file
from .rank import RankTrace

class Trace:
    """A run directory: every rank's trace, keyed by rank."""

    def __init__(self, run_dir: str, ranks: dict[int, RankTrace], unreadable: dict[str, str]):
        self.run_dir = run_dir
        self.ranks = dict(sorted(ranks.items()))
        self.unreadable = unreadable  # file -> reason, for ranks that could not be read

    @property
    def size_bytes(self) -> int:
        return sum(r.size_bytes for r in self.ranks.values())

    def __repr__(self) -> str:
        return f"Trace({self.run_dir!r}, ranks={list(self.ranks)})"


def trace_files(path: str) -> list[str]:
    """The rank files of a run directory (or the one file given)."""
    if not os.path.exists(path):
        raise TraceNotFoundError(f"{path} does not exist; give the run directory passed to "
                                 "Recorder(model, run_dir)")
    if os.path.isfile(path):
        return [path]
    files = [os.path.join(path, n) for n in os.listdir(path) if _RANK_FILE.match(n)]
    if not files:
        started = _died_starting(path)
        if started:
            raise TraceNotFoundError(f"{path}: {started[min(started)]}")
        raise TraceNotFoundError(f"{path} holds no rank*.h5 trace files; give the run directory "
                                 "passed to Recorder(model, run_dir)")
    return sorted(files, key=rank_of_file)


def _died_starting(path: str) -> dict[str, str]:
    """{file name: reason} for ranks whose job ended before its first flush: the recorder
    builds rank{N}.h5 as rank{N}.h5.starting and renames it once it is readable."""
    if not os.path.isdir(path):
        return {}
    names = set(os.listdir(path))
    return {n: f"{n}: the job ended before its first data was flushed (within a moment of "
               "Recorder()), so this rank recorded nothing"
            for n in names if n.endswith(STARTING_SUFFIX) and _RANK_FILE.match(n[:-len(STARTING_SUFFIX)])
            and n[:-len(STARTING_SUFFIX)] not in names}


def load(run_dir) -> Trace:
    """Open a run directory (or one rank file) for reading.

    Raises a TraceError subclass with a one-line reason if nothing in it can be analyzed; a
    multi-rank run with some unreadable files loads the readable ones and lists the others in
    ``Trace.unreadable``.
    """
    run_dir = os.fspath(run_dir)
    ranks: dict[int, RankTrace] = {}
    unreadable: dict[str, str] = {}
    files = trace_files(run_dir)
    first_error = None
    for p in files:
        try:
            rt = RankTrace(p)
        except (TraceFormatError, SchemaVersionError) as e:
            first_error = first_error or e
            unreadable[p] = str(e)
            continue
        ranks[rt.rank] = rt
    if not ranks:
        raise first_error
    unreadable.update({os.path.join(run_dir, n): why for n, why in _died_starting(run_dir).items()})
    return Trace(run_dir, ranks, unreadable)
