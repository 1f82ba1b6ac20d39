"""out_of_memory (error): the job ran out of memory — at which step, how much it asked for, how
much was allocated and free, what held the memory then and what asked for more.

Data: ``oom_events`` — the CUDA allocator's out-of-memory observer (request size, allocated and
free device memory, with a snapshot of the allocator taken right then), and out-of-memory errors
that left the ``with Recorder(...)`` block (CUDA or CPU: the message, where it was raised, and a
census of live tensors). With a snapshot, what held the memory is the live blocks grouped by the
line of the job's code that allocated them, and what asked for more is the stack of the
allocator's ``oom`` history entry; without one (CPU), the largest tensor groups of the census and
the line the error was raised at. A process killed by the kernel's OOM killer leaves no event:
its trace just stops (the analyze command says the trace was not closed).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..memory_snapshot import history_peak, is_library, live_sites, oom_request
from ..trace import RankTrace


@dataclass(frozen=True)
class OutOfMemoryConfig:
    # How many allocation sites / tensor groups the finding lists, and how many frames of the
    # line that raised the error (enough to name the layer, short enough for a ticket).
    max_listed: int = 5
    max_frames: int = 4


class Evidence(FindingEvidence, total=False):
    device: str  # the device that ran out: "cuda:0", "cpu"
    requested_bytes: int  # the allocation that failed (bytes; -1: unknown)
    device_allocated_bytes: int  # allocated by tensors on the device when it failed (bytes; -1: unknown)
    device_reserved_bytes: int  # reserved by PyTorch's caching allocator then (bytes; -1: unknown)
    device_free_bytes: int  # free on the device then, as CUDA reports it (bytes; -1: unknown)
    device_total_bytes: int  # the device's memory (bytes; -1: unknown)
    rss_bytes: int  # the process's resident memory then (bytes; -1: unknown)
    events: int  # out-of-memory events in the whole run
    sources: list  # what saw the first one: "observer" (the CUDA allocator's), "exception" (an error raised)
    message: str  # the error's message (its first 500 characters)
    raised_at: list  # the innermost max_frames "file:line in fn" frames the error was raised at
    snapshot: int  # the allocator snapshot taken at the failure (its id in memory_snapshots)
    largest_sites: list  # its live memory by allocating line, largest first: {site, bytes, blocks, stack}
    failed_request: dict  # the request that failed, from the snapshot: {bytes, device_free, site, stack}
    history_peak_bytes: int  # the highest allocated memory the snapshot's history shows (bytes)
    largest_tensor_groups: list  # the census at the error, largest first: {device, dtype, shape, graph,
    #                              count, bytes}


KIND = "out_of_memory"
REQUIRES = ("oom_events/step",)
CONFIG = OutOfMemoryConfig  # its thresholds: a [out_of_memory] table of analyze --config
ORDER = 70  # among findings of one step and stage, the detectors run (and list) in this order

_ADVICE = (
    "Lower the memory a step needs: a smaller batch (with gradient accumulation to keep the "
    "effective batch), mixed precision (torch.autocast), activation checkpointing "
    "(torch.utils.checkpoint) for the largest layers, and no tensors kept across steps. Look at "
    "the allocation sites listed: the largest holders are what to shrink, the site that asked "
    "for more is where the step failed. Open the snapshot in https://pytorch.org/memory_viz "
    "(torchautopsy export RUN_DIR --memory-snapshot OUT.pickle) to see the timeline."
)
_ADVICE_FRAGMENTED = (
    " Much reserved memory was not allocated when the request failed: the cache is fragmented; "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually fixes that."
)
_ADVICE_CPU = (
    "The host ran out of memory: lower the batch or the data kept in memory (dataset caches, "
    "num_workers each holding a copy, tensors kept across steps), or use a machine with more RAM. "
    "The largest tensor groups listed are what held the memory when the allocation failed."
)


def _mib(n) -> str:
    if n is None or n < 0:
        return "unknown"
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"


def _own_code(lines: list[str]) -> str:
    """The innermost "file:line in fn" in the job's own code (else the innermost)."""
    for line in reversed(lines):
        if not is_library(line.rsplit(" in ", 1)[0].rsplit(":", 1)[0]):
            return line
    return lines[-1]


def detect(rt: RankTrace, cfg: OutOfMemoryConfig) -> list[Finding]:
    events = rt.oom_events
    if not len(events):
        return []
    oom = _measure(rt, cfg, events)
    return [Finding(KIND, "error", oom.step, [], _summary(oom), oom.evidence,
                    (_ADVICE if oom.cuda else _ADVICE_CPU) + (_ADVICE_FRAGMENTED if oom.fragmented else ""))]


@dataclass(frozen=True)
class _Oom:
    """The first time memory ran out, as the trace tells it."""

    step: int
    cuda: bool
    fragmented: bool  # enough memory was reserved but not allocated to serve the request
    times: int  # events in the whole run; more than at `step` when the job caught the error
    times_at_step: int
    evidence: dict


def _measure(rt: RankTrace, cfg: OutOfMemoryConfig, events) -> _Oom:
    first_step = int(events["step"].iloc[0])
    same = events[events["step"] == first_step]
    exc = same[same["source"] == "exception"]
    obs = same[same["source"] == "observer"]
    e = (obs if len(obs) else same).iloc[0]  # the allocator's observer saw most, when it ran
    requested = int(e["requested_bytes"]) if int(e["requested_bytes"]) >= 0 else (
        int(exc["requested_bytes"].iloc[0]) if len(exc) else -1)
    evidence: dict = {
        "device": str(e["device"]), "requested_bytes": requested,
        "device_allocated_bytes": int(e["device_allocated_bytes"]),
        "device_reserved_bytes": int(e["device_reserved_bytes"]),
        "device_free_bytes": int(e["device_free_bytes"]), "device_total_bytes": int(e["device_total_bytes"]),
        "rss_bytes": int(e["rss_bytes"]),
        "events": len(events), "sources": sorted(set(same["source"])),
    }
    if len(exc):
        evidence["message"] = str(exc["message"].iloc[0])[:500]
        raised = [line for line in str(exc["raised_at"].iloc[0]).splitlines() if line]
        if raised:
            evidence["raised_at"] = raised[-cfg.max_frames:]
    snaps = [int(s) for s in same["snapshot"] if int(s) >= 0]
    snaps = [s for s in snaps if s in set(int(x) for x in rt.memory_snapshots["snapshot"])]
    fragmented = False
    if snaps:
        requested, fragmented = _from_snapshot(rt, cfg, snaps[0], requested, evidence)
    groups = rt.oom_tensor_groups
    if len(groups) and len(exc):
        mine = groups[groups["event"] == int(exc.index[0])]
        mine = mine.sort_values("bytes", ascending=False).head(cfg.max_listed)
        evidence["largest_tensor_groups"] = [
            {"device": r.device, "dtype": r.dtype, "shape": r.shape, "graph": bool(r.graph),
             "count": int(r.count), "bytes": int(r.bytes)} for r in mine.itertuples()]
    evidence["requested_bytes"] = requested  # the snapshot's request when the event had no size
    return _Oom(first_step, evidence["device"].startswith("cuda"), fragmented, len(events), len(same), evidence)


def _from_snapshot(rt: RankTrace, cfg: OutOfMemoryConfig, snap: int, requested: int,
                   evidence: dict) -> tuple[int, bool]:
    """Add what the allocator snapshot taken at the failure says to ``evidence``; return the
    request's size (the snapshot's, if the event had none) and whether the cache was fragmented."""
    evidence["snapshot"] = snap
    evidence["largest_sites"] = [{"site": g["site"], "bytes": g["bytes"], "blocks": g["blocks"],
                                  "stack": g["stack"]} for g in live_sites(rt, snap, top=cfg.max_listed)]
    req = oom_request(rt, snap)
    if req is not None:
        evidence["failed_request"] = req
        requested = requested if requested >= 0 else req["bytes"]
    peak = history_peak(rt, snap, top=cfg.max_listed)
    if peak is not None:
        evidence["history_peak_bytes"] = peak["bytes"]
    reserved, allocated = evidence["device_reserved_bytes"], evidence["device_allocated_bytes"]
    if reserved < 0 or allocated < 0:  # the event did not say: the snapshot's totals
        srow = rt.memory_snapshots[rt.memory_snapshots["snapshot"] == snap].iloc[0]
        reserved, allocated = int(srow["reserved_bytes"]), int(srow["allocated_bytes"])
    return requested, requested > 0 and reserved - allocated >= requested


def _summary(oom: _Oom) -> str:
    ev = oom.evidence
    requested = ev["requested_bytes"]
    if oom.cuda:
        state = (f"a request for {_mib(requested)} failed with {_mib(ev['device_allocated_bytes'])} "
                 f"allocated by tensors, {_mib(ev['device_reserved_bytes'])} reserved by PyTorch's "
                 f"allocator and {_mib(ev['device_free_bytes'])} free on the device")
        if ev["device_total_bytes"] > 0:
            state += f" (of {_mib(ev['device_total_bytes'])})"
    else:
        state = (f"a request for {_mib(requested)} failed with the process holding "
                 f"{_mib(ev['rss_bytes'])} resident")
    summary = f"Out of memory at step {oom.step} on {ev['device']}: {state}.{_holders(ev)}{_asked(ev)}"
    if oom.times > oom.times_at_step:
        summary += f" Memory ran out {oom.times} times in all (the job caught the error and went on)."
    return summary


def _holders(ev: dict) -> str:
    """What held the memory: the snapshot's allocation sites, else the census's tensor groups."""
    if ev.get("largest_sites"):
        return " Largest holders: " + "; ".join(f"{g['site']} ({_mib(g['bytes'])})"
                                                for g in ev["largest_sites"][:3]) + "."
    if ev.get("largest_tensor_groups"):
        return " Largest tensor groups: " + "; ".join(
            f"{g['count']} x {g['shape']} {g['dtype']} on {g['device']} ({_mib(g['bytes'])})"
            for g in ev["largest_tensor_groups"][:3]) + "."
    return ""


def _asked(ev: dict) -> str:
    """What asked for more: the snapshot's failed request, else the job's line that raised."""
    if "failed_request" in ev:
        return f" The request came from {ev['failed_request']['site']}."
    if ev.get("raised_at"):
        return f" It failed at {_own_code(ev['raised_at'])}."
    return ""
