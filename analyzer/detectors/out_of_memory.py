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

from ..findings import Finding
from ..memory_snapshot import history_peak, is_library, live_sites, oom_request
from ..trace import RankTrace


@dataclass(frozen=True)
class OutOfMemoryConfig:
    # How many allocation sites / tensor groups the finding lists, and how many frames of the
    # line that raised the error (enough to name the layer, short enough for a ticket).
    max_listed: int = 5
    max_frames: int = 4


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
    first_step = int(events["step"].iloc[0])
    same = events[events["step"] == first_step]
    obs = same[same["source"] == "observer"]
    exc = same[same["source"] == "exception"]
    e = (obs if len(obs) else same).iloc[0]
    device = str(e["device"])
    cuda = device.startswith("cuda")
    requested = int(e["requested_bytes"]) if int(e["requested_bytes"]) >= 0 else (
        int(exc["requested_bytes"].iloc[0]) if len(exc) else -1)
    evidence: dict = {
        "device": device, "requested_bytes": requested,
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
    holders = ""
    asked = ""
    advice = _ADVICE if cuda else _ADVICE_CPU
    if snaps:
        snap = snaps[0]
        evidence["snapshot"] = snap
        sites = live_sites(rt, snap, top=cfg.max_listed)
        evidence["largest_sites"] = [{"site": g["site"], "bytes": g["bytes"], "blocks": g["blocks"],
                                      "stack": g["stack"]} for g in sites]
        if sites:
            holders = " Largest holders: " + "; ".join(f"{g['site']} ({_mib(g['bytes'])})" for g in sites[:3]) + "."
        req = oom_request(rt, snap)
        if req is not None:
            evidence["failed_request"] = req
            requested = requested if requested >= 0 else req["bytes"]
            asked = f" The request came from {req['site']}."
        peak = history_peak(rt, snap, top=cfg.max_listed)
        if peak is not None:
            evidence["history_peak_bytes"] = peak["bytes"]
        srow = rt.memory_snapshots[rt.memory_snapshots["snapshot"] == snap].iloc[0]
        reserved, allocated = evidence["device_reserved_bytes"], evidence["device_allocated_bytes"]
        if reserved < 0 or allocated < 0:
            reserved, allocated = int(srow["reserved_bytes"]), int(srow["allocated_bytes"])
        if requested > 0 and reserved - allocated >= requested:
            advice += _ADVICE_FRAGMENTED
    groups = rt.oom_tensor_groups
    if len(groups) and len(exc):
        index = int(exc.index[0])
        mine = groups[groups["event"] == index].sort_values("bytes", ascending=False).head(cfg.max_listed)
        evidence["largest_tensor_groups"] = [
            {"device": r.device, "dtype": r.dtype, "shape": r.shape, "graph": bool(r.graph),
             "count": int(r.count), "bytes": int(r.bytes)} for r in mine.itertuples()]
        if not holders and len(mine):
            holders = " Largest tensor groups: " + "; ".join(
                f"{int(r.count)} x {r.shape} {r.dtype} on {r.device} ({_mib(r.bytes)})"
                for r in mine.head(3).itertuples()) + "."
    if not asked and evidence.get("raised_at"):
        asked = f" It failed at {_own_code(evidence['raised_at'])}."
    evidence["requested_bytes"] = requested
    if cuda:
        state = (f"a request for {_mib(requested)} failed with {_mib(evidence['device_allocated_bytes'])} "
                 f"allocated by tensors, {_mib(evidence['device_reserved_bytes'])} reserved by PyTorch's "
                 f"allocator and {_mib(evidence['device_free_bytes'])} free on the device")
        if evidence["device_total_bytes"] > 0:
            state += f" (of {_mib(evidence['device_total_bytes'])})"
    else:
        state = (f"a request for {_mib(requested)} failed with the process holding "
                 f"{_mib(evidence['rss_bytes'])} resident")
    summary = f"Out of memory at step {first_step} on {device}: {state}.{holders}{asked}"
    if len(events) > len(same):
        summary += f" Memory ran out {len(events)} times in all (the job caught the error and went on)."
    return [Finding(KIND, "error", first_step, [], summary, evidence, advice)]
