"""The per-rank pass on a Dask cluster (``analyze --scheduler tcp://HOST:8786`` or ``local:N``).

The same map as parallel.py's worker processes, one Dask task a rank: the worker opens that
rank's files where they lie (a path on a filesystem the workers share with this process), runs
``rank_pass`` (its detectors, its digest) and sends back only its findings and digest; this
process does the merge and the cross-rank detectors as without a cluster. Dask is imported only
here, only when a scheduler is given (the ``cluster`` extra): the core install never needs it.

A rank whose task fails -- its worker died (killed for memory, the node lost: Dask retries it on
another worker, then gives up), or the pass raised there -- is that rank's ``unreadable_rank``
finding, never a lost analysis. Ctrl-C cancels the tasks still queued or running."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterator

from .errors import ClusterError
from .parallel import RankResult, Shared, _held_pass, _own_problem, could_not_read
from .trace import Trace, safety
from .trace.shards import WholeParams

# How long to wait for a scheduler that does not answer (a wrong host, a firewall) before saying
# so: long enough for a scheduler across a busy cluster network, short enough that a typo is told
# within seconds rather than after Dask's default 30 s. (A port nothing listens on: at once, _answers.)
CONNECT_TIMEOUT_S = 10.0
INSTALL = 'pip install "torchautopsy[cluster]"'
_LOCAL = re.compile(r"local:(\d+)")
_ADDRESS = re.compile(r"([a-z][a-z0-9+.-]*://)?[^\s/:]+(:\d+)?")


def check_address(address: str) -> None:
    """Refuse an address that is neither ``local:N`` nor a scheduler's ``[tcp://]HOST[:PORT]``,
    and a machine without Dask, before anything is read (one line, exit code 2)."""
    local = _LOCAL.fullmatch(address)
    if local is None and (address.startswith("local:") or not _ADDRESS.fullmatch(address)):
        raise ClusterError(f"--scheduler {address!r}: give a Dask scheduler's address (tcp://HOST:8786) "
                           "or local:N for a local cluster of N worker processes")
    if local is not None and not 1 <= int(local.group(1)) <= 1024:
        raise ClusterError(f"--scheduler {address!r}: a local cluster has 1 to 1024 workers")
    if importlib.util.find_spec("distributed") is None:
        raise ClusterError(f"--scheduler needs Dask, which is not installed: {INSTALL}")


SCHEDULER_HELP = ("Run the per-rank pass on a Dask cluster: a scheduler's address (tcp://HOST:8786; its "
                  "workers must see RUN_DIR at the same path) or local:N (N local worker processes). Needs "
                  f"{INSTALL}. Default: local worker processes, one per CPU.")


@contextlib.contextmanager
def scheduler_for(address: str | None) -> Iterator:
    """The commands' ``--scheduler``: a client connected to it, or None without one."""
    if address is None:
        yield None
        return
    with connect(address) as client:
        yield client


@contextlib.contextmanager
def connect(address: str) -> Iterator:
    """A dask.distributed Client of the scheduler at ``address``, or of a local cluster of N
    single-threaded worker processes for ``local:N`` (closed on exit). Dask's own log lines are
    kept off the terminal meanwhile: what goes wrong is said in findings or in one line."""
    check_address(address)
    import dask
    from distributed import Client, LocalCluster

    quiet = logging.getLogger("distributed")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with contextlib.ExitStack() as stack:
            local = _LOCAL.fullmatch(address)
            try:
                if local:
                    # Workers that may start processes (Dask makes them daemons by default, which
                    # may not): the files' probe children (prober below).
                    stack.enter_context(dask.config.set({"distributed.worker.daemon": False}))
                    # One thread a worker: HDF5 reads serialize on h5py's lock, so threads would not
                    # help. A free port for the scheduler's HTTP server (None still tries 8787, and
                    # warns on stderr when another cluster on this machine holds it).
                    cluster = stack.enter_context(LocalCluster(
                        n_workers=int(local.group(1)), threads_per_worker=1, processes=True,
                        dashboard_address=":0", silence_logs=logging.CRITICAL))
                    client = stack.enter_context(Client(cluster, timeout=CONNECT_TIMEOUT_S))
                else:
                    _answers(address)
                    client = stack.enter_context(Client(address, timeout=CONNECT_TIMEOUT_S))
            except (OSError, TimeoutError, ValueError) as e:
                raise ClusterError(f"--scheduler {address}: could not reach the Dask scheduler "
                                   f"({_line(e)})") from None
            yield client
    finally:
        quiet.setLevel(level)


def _answers(address: str) -> None:
    """Raise OSError if nothing listens at a TCP scheduler's address (a typo'd port, a scheduler
    not running: the host refuses at once, yet Dask retries a refused connection until its
    timeout, 10 s of silence for a typo) or it does not answer within the timeout. Any other
    outcome (it accepts; the name does not resolve yet) is left to Dask's own connect and retries."""
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, loc = parse_address(address)
        host, port = parse_host_port(loc)
    except ValueError:
        return
    if scheme not in ("tcp", "tls"):
        return
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except ConnectionRefusedError:
        raise OSError(f"connection refused: nothing listens on {host}:{port}; is the scheduler running, "
                      "and on that port?") from None
    except TimeoutError:
        raise OSError(f"no answer from {host}:{port} within {CONNECT_TIMEOUT_S:.0f} s") from None
    except OSError:
        return


def prober(client):
    """load()'s prober on the cluster: the files decoded by the workers' probe children
    (trace/probe.py), PROBE_BATCH files a task, instead of this machine's, so that this process
    only reads their headers; it trusts what the workers checked (safety.trust: a file of the same
    identity is not walked again). A batch whose task fails is decoded here, as without a cluster:
    so it is on workers that may not start processes (Dask's default: start them with
    DASK_DISTRIBUTED__WORKER__DAEMON=False; ``local:N`` does)."""
    from distributed import as_completed

    from .trace.probe import checked, damaged
    from .trace.run_dir import PROBE_BATCH

    def check(files: list[str], sizes: list[int], told) -> dict[str, str]:
        tag = uuid.uuid4().hex[:8]
        batches = {}
        for i in range(0, len(files), PROBE_BATCH):
            batch = files[i:i + PROBE_BATCH]
            fut = client.submit(checked, [os.path.abspath(p) for p in batch], sizes[i:i + PROBE_BATCH],
                                key=f"torchautopsy-probe-{i}-{tag}", pure=False)
            batches[fut] = (batch, sizes[i:i + PROBE_BATCH])
        bad, done = {}, 0
        try:
            for fut in as_completed(list(batches)):
                batch, sz = batches.pop(fut)
                try:
                    why, keys = fut.result()
                except Exception:  # (its worker died: decoded here)
                    bad.update(damaged(batch, sz))
                else:
                    safety.trust(keys)
                    bad.update({p: why[os.path.abspath(p)] for p in batch if os.path.abspath(p) in why})
                done += len(batch)
                told(done)
        finally:
            if batches:
                client.cancel(list(batches), force=True)
        return bad

    return check


def per_rank(trace: Trace, rank_pass: Callable[[Trace, int], RankResult], scheduler,
             progress: Callable[[int, int], None] | None = None, cfg=None) -> dict[int, RankResult]:
    """{rank: (findings, Light)} for every rank, each rank's pass a task on the Dask cluster of
    ``scheduler`` (a Client, or an address connect() takes): its digest leaves the worker reduced
    (cross_rank/light.py). With ``cfg`` (the AnalysisConfig), each Light also holds its straggler
    verdict and peaks, judged on the workers in a second pass (cluster_passes.py). The findings
    equal parallel.per_rank's; a sharded run is read here and gives full digests, as there."""
    return per_rank_counted(trace, rank_pass, scheduler, progress, cfg)[0]


def per_rank_counted(trace: Trace, rank_pass: Callable[[Trace, int], RankResult], scheduler,
                     progress: Callable[[int, int], None] | None = None, cfg=None):
    """per_rank's results, and with ``cfg`` the ranks' Counts (cross_rank/counters.py) merged in
    the cluster's tree of tasks (None: not made there; the caller counts them itself, analyzer/run.py)."""
    if isinstance(scheduler, str):
        with connect(scheduler) as client:
            return per_rank_counted(trace, rank_pass, client, progress, cfg)
    ranks = list(trace.attempts)
    if any(isinstance(rt, WholeParams) for rt in trace.ranks.values()):
        # Sharded parameters (FSDP2): each rank's figures combine every rank's shards, read here.
        return {r: _own_problem(trace, r, lambda r=r: _held_pass(trace, r, rank_pass)) for r in ranks}, None
    from distributed import as_completed

    from .cluster_passes import first_pass, judge

    files = {r: [os.path.abspath(a.trace.path) for a in trace.attempts[r]] for r in ranks}
    passed = {r: [safety.path_identity(p) for p in files[r]] for r in ranks}
    run_dir = os.path.abspath(trace.run_dir)  # (the workers' working directory is not ours)
    tag = uuid.uuid4().hex[:8]
    futures = {scheduler.submit(first_pass, run_dir, files[r], r, rank_pass, passed[r],
                                key=f"torchautopsy-rank-{r}-{tag}", pure=False): r for r in ranks}
    results: dict[int, RankResult] = {}
    counts = None
    share = Shared()
    try:
        for fut in as_completed(futures):
            r = futures.pop(fut)
            results[r] = share(_result(fut, r, files[r], getattr(trace.ranks.get(r), "path", None)))
            fut.release()  # (its result is here now: the cluster need not keep it)
            if progress:
                progress(len(results), len(ranks))
        if cfg is not None:
            lights = {r: d for r, (_, d) in results.items() if d is not None}
            counts = judge(scheduler, {r: (run_dir, files[r], r, passed[r]) for r in lights}, lights,
                           list(results.values()), cfg, tag)
    finally:
        if futures:  # (Ctrl-C, or this process failing: the tasks left are of no use to anyone)
            scheduler.cancel(list(futures), force=True)
    return dict(sorted(results.items())), counts


def _result(fut, rank: int, files: list[str], path: str | None) -> RankResult:
    """A finished task's findings and digest, the digest naming the file as this process does
    (``path``: the worker read it by its absolute path);
    a task that failed or was lost: the rank's "could not read" finding."""
    try:
        found, digest = fut.result()
    except Exception as e:  # (KilledWorker: its worker died each time it ran; or what the pass raised)
        return [could_not_read(rank, files[0], f"on the Dask cluster, {_why(e)}")], None
    except BaseException as e:
        if type(e).__name__ not in ("CancelledError", "FutureCancelledError"):
            raise  # (KeyboardInterrupt, SystemExit)
        return [could_not_read(rank, files[0], "on the Dask cluster, its task was cancelled (the scheduler "
                                               "restarted or went away)")], None
    if digest is not None and path is not None:
        digest.file = path
    return found, digest


def _why(e: BaseException) -> str:
    if type(e).__name__ == "KilledWorker":
        return "the worker reading it died each time it tried (out of memory, or the node was lost)"
    return f"reading it failed: {type(e).__name__}: {_line(e)}"


def _line(e: BaseException) -> str:
    """The first line of an error's message, short (it ends up on a terminal line or in a finding)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."

