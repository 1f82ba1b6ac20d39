"""A job restarted into its run directory: each attempt of a rank writes its own file
(``rank{N}.h5``, then ``rank{N}.attempt{K}.h5``, K = 2, 3, ...; recorder/trace_file/attempts.py), and the
reader joins them into one timeline per rank.

The timeline rule: **a later attempt replaces the steps it re-ran.** An attempt that resumed at
step 50 from a checkpoint holds the steps that led to the model the job went on with; the rows
of earlier attempts from step 50 on belong to a branch the job abandoned. So a rank's timeline is
each attempt's rows below the first step of every later attempt, then the later attempt's:
strictly increasing steps, one row per step, as in a trace of one attempt.

Nothing is hidden, though: the detectors run on every attempt's file whole (each is one
process: its memory, its black box, its sites are its own), and a finding in an attempt of a
restarted rank says which attempt and file it comes from, and whether a later attempt ran its
step again. A NaN at step 70 of an attempt pre-empted at 80, whose restart resumed at 50 and ran
cleanly, is still reported, at step 70, attempt 1.

``RankTimeline`` stitches what lines up across attempts (the per-step tables and the activation
and update-ratio samples, of the same model); everything tied to one file (stored tensors, the
black box, snapshots, histograms, activity and attention windows, census, CUDA memory, profiler)
is the last attempt's: ``Trace.attempts[rank]`` has each attempt's own ``RankTrace``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .format import MODULE_STATS, PARAM_STATS
from .rank import RankTrace
from .streaming import _row_selection

# rank{N}.h5 is attempt 1; rank{N}.attempt{K}.h5 attempt K >= 2 (attempt1 is never written)
ATTEMPT_FILE = re.compile(r"^rank(\d+)(?:\.attempt([2-9]|[1-9]\d+))?\.h5$")
_SAMPLED = ("activations", "updates")  # sampled tables of fixed width: stitched by their steps


def parse_name(name: str) -> tuple[int, int] | None:
    """(rank, attempt) of a trace file's name, or None for another name."""
    m = ATTEMPT_FILE.match(os.path.basename(name))
    return (int(m.group(1)), int(m.group(2) or 1)) if m else None


@dataclass
class Attempt:
    number: int
    trace: RankTrace
    kept: int = 0  # its first rows that are in the rank's timeline
    cut: float = float("inf")  # the first step a later attempt ran again (inf: none did)
    joined: bool = True  # in the rank's timeline (False: another run's, see Trace.notes)

    @property
    def file(self) -> str:
        return os.path.basename(self.trace.path)

    @property
    def first(self) -> int | None:
        return int(self.trace.step_index[0]) if self.trace.n_steps else None

    @property
    def last(self) -> int | None:
        return int(self.trace.step_index[-1]) if self.trace.n_steps else None

    @property
    def rerun(self) -> tuple[int, int] | None:
        """(first, last) of its steps a later attempt ran again, or None."""
        if self.trace.n_steps == self.kept:
            return None
        return int(self.trace.step_index[self.kept]), self.last


def _number(rt: RankTrace) -> int:
    parsed = parse_name(rt.path)
    if parsed is not None:
        return parsed[1]
    k = rt.meta.get("attempt")  # a file given by another name
    return k if isinstance(k, int) and not isinstance(k, bool) and 0 < k < 10**9 else 1


def _mismatch(a: RankTrace, b: RankTrace) -> str | None:
    """Why two files cannot be attempts of one run (another model), or None."""
    if a.param_names != b.param_names or a.param_shapes != b.param_shapes:
        return f"{len(b.param_names):,} parameter tensors, not the same {len(a.param_names):,}" \
            if a.param_names != b.param_names else "parameters of other shapes"
    if a.module_names != b.module_names:
        return f"{len(b.module_names):,} modules against {len(a.module_names):,}"
    return None


def group(traces: list[RankTrace]) -> tuple[dict[int, RankTrace], dict[int, list[Attempt]], list[tuple[str, str]]]:
    """(rank -> its timeline, rank -> its attempts in order, (kind, one-line note)s) of the readable files
    of a run directory. A rank with one file keeps that file's RankTrace itself."""
    by_rank: dict[int, list[Attempt]] = {}
    for rt in traces:
        if "rank" not in rt.meta and parse_name(rt.path) is not None:
            rt.rank = parse_name(rt.path)[0]  # (format.rank_of_file knows rank{N}.h5 only)
        by_rank.setdefault(rt.rank, []).append(Attempt(_number(rt), rt))
    ranks, notes = {}, []
    for rank, attempts in sorted(by_rank.items()):
        attempts.sort(key=lambda a: (a.number, a.trace.meta.get("start_unix", 0.0)))
        chain = _chain(rank, attempts, notes)
        if len(chain) == 1:  # one file: read as it always was
            chain[0].kept = chain[0].trace.n_steps
            ranks[rank] = chain[0].trace
        else:
            _cut(chain)
            ranks[rank] = RankTimeline(chain)
        by_rank[rank] = attempts
    return ranks, by_rank, notes


def _chain(rank: int, attempts: list[Attempt], notes: list) -> list[Attempt]:
    """The newest run's attempts: a file recording another model starts another run (files
    of an unrelated job in the same directory); earlier runs' attempts are analyzed apart."""
    start = 0
    for i in range(1, len(attempts)):
        prev, cur = attempts[i - 1], attempts[i]
        why = _mismatch(prev.trace, cur.trace)
        if why is not None:
            notes.append(("mixed_runs", f"rank {rank}: {cur.file} records another model than {prev.file} ({why}): "
                          f"not attempts of one run; each is analyzed on its own, the timeline is {cur.file}'s run"))
            start = i
            continue
        w0, w1 = prev.trace.meta.get("world_size"), cur.trace.meta.get("world_size")
        if w0 is not None and w1 is not None and w0 != w1:
            notes.append(("world_size", f"rank {rank}: {cur.file} ran with world size {w1}, {prev.file} with {w0} "
                          f"(an elastic restart, or another job's files in this directory?)"))
    for a in attempts[:start]:
        a.joined, a.kept = False, a.trace.n_steps
    return attempts[start:]


def _cut(chain: list[Attempt]) -> None:
    """Each attempt keeps its rows below the first step of every later attempt."""
    cut = float("inf")
    for a in reversed(chain):
        a.cut = cut
        a.kept = int(np.searchsorted(a.trace.step_index, cut, "left")) if np.isfinite(cut) else a.trace.n_steps
        if a.first is not None:
            cut = min(cut, a.first)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    out.flags.writeable = False
    return out


class RankTimeline(RankTrace):
    """One rank's attempts as one RankTrace: per-step tables and activation and update-ratio
    samples stitched by the timeline rule; the rest read from the last attempt's file."""

    def __init__(self, chain: list[Attempt]):
        first, last = chain[0].trace, chain[-1].trace
        # What RankTrace.__init__ read; not what the last attempt cached (its step_index...).
        self.__dict__.update({k: v for k, v in vars(last).items()
                              if not isinstance(getattr(type(last), k, None), cached_property)})
        self.attempts = chain
        self.n_steps = sum(a.kept for a in chain)
        self.size_bytes = sum(a.trace.size_bytes for a in chain)
        self.meta = {**last.meta, "attempts": len(chain)}
        for k in ("start_time", "start_unix"):  # the timeline starts with its first attempt
            if k in first.meta:
                self.meta[k] = first.meta[k]

    def _segments(self, name: str) -> list[tuple[RankTrace, int]] | None:
        """(attempt's trace, its rows in the timeline) of a stitched dataset; None for others."""
        table, _, col = name.partition("/")
        if table == "steps" or (table == "params" and col in PARAM_STATS) or (table == "modules" and col in MODULE_STATS):
            return [(a.trace, a.kept) for a in self.attempts]
        if table in _SAMPLED:
            return self._sampled_segments[table]
        return None

    @cached_property
    def _sampled_segments(self) -> dict[str, list[tuple[RankTrace, int]]]:
        return {t: [(a.trace, int(np.searchsorted(a.trace.sample_steps(t), a.cut, "left"))) for a in self.attempts]
                for t in _SAMPLED}

    @cached_property
    def step_index(self) -> np.ndarray:
        return _concat([a.trace.step_index[:a.kept] for a in self.attempts])

    def _step_column(self, col: str) -> np.ndarray:
        return _concat([a.trace._step_column(col)[:a.kept] for a in self.attempts])

    def _sampled_steps(self, table: str, cols) -> np.ndarray:
        segs = self._segments(table + "/step") if table in _SAMPLED else None
        if segs is None:
            return super()._sampled_steps(table, cols)
        return _concat([rt.sample_steps(table)[:keep] for rt, keep in segs])

    def _read(self, name: str, rows: int | None = None, text: bool = False, ndim: int | None = None) -> np.ndarray:
        segs = self._segments(name)
        if segs is None:
            return super()._read(name, rows, text, ndim)
        parts, left = [], rows
        for rt, keep in segs:
            n = keep if left is None else max(0, min(keep, left))
            parts.append(rt._read(name, n, text, ndim))
            left = None if left is None else left - n
        return _concat(parts)

    def _read_rows(self, name: str, rows, n: int) -> tuple[np.ndarray, np.ndarray]:
        segs = self._segments(name)
        if segs is None:
            return super()._read_rows(name, rows, n)
        sel = _row_selection(slice(None) if rows is None else rows, min(n, sum(k for _, k in segs)))
        idx = np.arange(sel.start, sel.stop, sel.step) if isinstance(sel, slice) else sel
        ascending = not isinstance(sel, slice) or sel.step > 0  # (chosen rows come sorted, unique)
        order, back = (idx, None) if ascending else np.unique(idx, return_inverse=True)
        parts, start = [], 0
        for rt, keep in segs:
            lo, hi = np.searchsorted(order, (start, start + keep))
            local = order[lo:hi] - start
            if local.size:
                contiguous = int(local[-1]) - int(local[0]) + 1 == local.size
                parts.append(rt._read_rows(name, slice(int(local[0]), int(local[-1]) + 1) if contiguous
                                           else local, keep)[1])
            start += keep
        if not parts:  # nothing asked: an empty block of the dataset's width
            rt, keep = segs[-1]
            parts.append(rt._read_rows(name, np.zeros(0, np.int64), keep)[1])
        data = _concat(parts)
        if back is not None:  # a slice read backwards: given back in its order
            data = data[back]
            data.flags.writeable = False
        return idx, data

    def blocks(self, name: str, stop: int | None = None, start: int = 0):
        segs = self._segments(name)
        if segs is None:
            yield from super().blocks(name, stop, start)
            return
        total = sum(k for _, k in segs)
        stop = total if stop is None else min(stop, total)
        offset = 0
        for rt, keep in segs:
            lo, hi = max(start - offset, 0), min(stop - offset, keep)
            if hi > lo:
                for a, block in rt.blocks(name, stop=hi, start=lo):
                    yield offset + a, block
            offset += keep


def restarts(trace) -> list[tuple[int, Attempt, Attempt | None]]:
    """(rank, attempt, the attempt before it) of every attempt after a rank's first."""
    out = []
    for rank, attempts in trace.attempts.items():
        for i, a in enumerate(attempts):
            if i or a.number > 1:
                out.append((rank, a, attempts[i - 1] if i else None))
    return out
