"""The per-rank pass of a many-rank run: each rank read, its detectors run and its digest made
in a worker process, a rank at a time per worker.

A worker opens one rank's files (its attempts), runs every per-rank detector on it and returns
its findings and its digest (cross_rank/digest.py), then lets the rank go: a worker's memory is
one rank's, whatever the number of ranks, and the parent holds only findings and digests.
Workers are spawned (not forked): the parent may hold HDF5 state and threads that a fork would
copy half-way. A run whose parameters are sharded (FSDP2) is read in one process: its
whole-parameter figures combine every rank's shards (trace/shards.py)."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from .cross_rank.digest import RankDigest
from .errors import TraceError
from .findings import Finding
from .trace import Trace, safety
from .trace.run_dir import load_files
from .trace.shards import WholeParams

# A rank's findings and digest (None: the digest could not be made; a finding says why).
RankResult = tuple[list[Finding], RankDigest | None]


# Below this many bytes of rank files, worker processes cost more than they save: each spawned
# worker takes ~1.5 CPU-s to start (the interpreter, numpy, pandas, h5py, the analyzer), about
# what reading ~150 MiB of rank files takes, so smaller runs are read faster in this process
# (measured: benchmarks/README.md, "Worker processes only where they pay").
WORKERS_FROM_BYTES = 256 << 20


def files_bytes(*traces: Trace) -> int:
    """The size of the traces' rank files (every attempt's)."""
    total = 0
    for t in traces:
        for attempts in t.attempts.values():
            for a in attempts:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(a.trace.path)
    return total


def workers_for(n_ranks: int, nbytes: int = WORKERS_FROM_BYTES) -> int:
    """Worker processes for n ranks whose files hold ``nbytes``: one per CPU this process may use
    (at most 32); none for one rank, nor for files too small to repay starting them."""
    if nbytes < WORKERS_FROM_BYTES:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (macOS, Windows)
        cpus = os.cpu_count() or 1
    return max(1, min(n_ranks, cpus, 32))


def per_rank(trace: Trace, rank_pass: Callable[[Trace, int], RankResult], workers: int = 1,
             progress: Callable[[int, int], None] | None = None) -> dict[int, RankResult]:
    """{rank: rank_pass(that rank's trace, rank)} for every rank, in worker processes where that
    pays (several ranks, not sharded)."""
    ranks = list(trace.attempts)
    n = min(workers, len(ranks))
    sharded = any(isinstance(rt, WholeParams) for rt in trace.ranks.values())
    results: dict[int, RankResult] = {}
    share = Shared()
    if n <= 1 or len(ranks) < 2 or sharded:
        for done, r in enumerate(ranks):
            results[r] = share(_own_problem(trace, r, lambda r=r: _held_pass(trace, r, rank_pass)))
            if progress:
                progress(done + 1, len(ranks))
        return results
    files = {r: [a.trace.path for a in trace.attempts[r]] for r in ranks}
    # The files' identities this process checked (or its probe did): the workers skip their walks.
    passed = {r: [safety.path_identity(p) for p in files[r]] for r in ranks}
    try:
        with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_one_rank, trace.run_dir, files[r], r, rank_pass, passed[r]): r for r in ranks}
            for fut in as_completed(futures):
                r = futures[fut]
                results[r] = share(_own_problem(trace, r, fut.result))
                if progress:
                    progress(len(results), len(ranks))
    except (OSError, NotImplementedError, BrokenProcessPool):
        # No worker processes here (a sandbox without semaphores or fork/exec), or one was killed
        # (by the OOM killer): the ranks not yet read are read here, one at a time.
        for r in ranks:
            if r not in results:
                results[r] = share(_own_problem(trace, r, lambda r=r: _held_pass(trace, r, rank_pass)))
                if progress:
                    progress(len(results), len(ranks))
    return dict(sorted(results.items()))


class Shared:
    """Holds each per-step array of the ranks' digests once when ranks send equal ones: under DDP
    every rank has the same step numbers, the same all-reduced gradient norms, the same parameter
    names, often the same times (1,024 ranks x 10,000 steps: ~80 MB a series held once, not 1,024
    times). Applied to each result as it arrives, so the parent never holds the copies; the shared
    arrays are made read-only (a consumer that wrote into one would change every rank's)."""

    FIELDS = ("steps", "time_unix", "grad_norm", "local_grad", "fp_steps", "param_names")

    def __init__(self):
        self.seen: dict[tuple, object] = {}

    def __call__(self, result: RankResult) -> RankResult:
        digest = result[1]
        if digest is not None:
            for name in self.FIELDS:
                value = getattr(digest, name, None)  # (a Light has no per-step series)
                if value is None:
                    continue
                if isinstance(value, np.ndarray):
                    key = (name, value.dtype.str, value.shape, hashlib.blake2b(value.tobytes(), digest_size=16).digest())
                else:
                    key = (name, tuple(value))
                kept = self.seen.setdefault(key, value)
                if isinstance(kept, np.ndarray):
                    kept.flags.writeable = False
                setattr(digest, name, kept)
        return result


def _own_problem(trace: Trace, rank: int, result: Callable[[], RankResult]) -> RankResult:
    """result(); a rank file found unusable only now (by a detector's read, after the files were
    opened) is that rank's "could not read" when the run has other ranks (as on a Dask cluster),
    the run's one line and exit 2 when it is the only one."""
    try:
        return result()
    except TraceError as e:
        if len(trace.attempts) < 2:
            raise
        path = trace.attempts[rank][0].trace.path
        return [could_not_read(rank, path, str(e).removeprefix(f"{path}: "))], None


def could_not_read(rank: int | None, file: str, why: str) -> Finding:
    """The "could not read" finding of a rank file (unreadable_rank): ``why`` says what happened."""
    return Finding("unreadable_rank", "warning", None, [], f"{file}: {why}" if rank is not None else why,
                   {"file": file}, "Copy that rank's file again from the job's run directory.", rank=rank)


def _one_rank(run_dir: str, files: list[str], rank: int, rank_pass, passed=()) -> RankResult:
    """In a worker: one rank's files read as a run of one rank, then its pass. ``passed``: the
    identities of those files the parent checked (safety.py): a file still of that identity (not
    changed since) is not walked again here."""
    safety.trust(passed)
    return _held_pass(load_files(run_dir, files, died_starting=False, probed=True), rank, rank_pass)  # (the parent probed them)


def _held_pass(trace: Trace, rank: int, rank_pass) -> RankResult:
    """rank_pass with the rank's files kept open: its detectors' ~200 reads open each file once."""
    with contextlib.ExitStack() as stack:
        traces = [a.trace for a in trace.attempts.get(rank, ())]
        for rt in traces + [t for t in [trace.ranks.get(rank)] if not any(t is x for x in traces)]:
            try:
                stack.enter_context(rt.held())
            except (AttributeError, TraceError):  # (gone: each read opens it and says why)
                pass
        return rank_pass(trace, rank)
