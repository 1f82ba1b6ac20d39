"""The CUDA caching allocator's own record: its history of allocations and frees, snapshots of
its state, and out-of-memory events.

On a CUDA model the recorder starts ``torch.cuda.memory._record_memory_history`` (bounded to
``cuda_history_entries`` events, Python stacks only, stacks kept for allocations only: the
cheapest setting that still tells where each live block was allocated), unless the job already
records one. It takes ``torch.cuda.memory._snapshot()`` on a sparse schedule, when memory climbs
to a new high (the census's peak trigger), and when the allocator runs out of memory (an
out-of-memory observer). Each snapshot is turned into plain rows on the writer thread — segments,
blocks, trace entries, with stack frames deduplicated into a table — so the trace holds no pickle.
docs/trace_format.md describes the tables; analyzer/memory_snapshot.py rebuilds the snapshot dict.
"""

from __future__ import annotations

import json
import re
import time

import torch

from .readings import cuda_bytes

# Optional keys of each snapshot entity, as a bit mask per row (the `keys` column): a snapshot
# from another torch version lacks some, and the export rebuilds exactly the keys it had.
SNAPSHOT_KEYS = ("device_traces", "allocator_settings")
SEGMENT_KEYS = ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks")
BLOCK_KEYS = ("address", "size", "requested_size", "state", "frames")
TRACE_KEYS = ("action", "addr", "device_free", "size", "stream", "time_us", "frames",
              "compile_context", "user_metadata")
FRAME_KEYS = ("filename", "line", "name")


def _mask(d: dict, keys: tuple[str, ...]) -> int:
    return sum(1 << i for i, k in enumerate(keys) if k in d)


def _extra(d: dict, keys: tuple[str, ...]) -> str:
    """Keys this code does not know (a newer torch's, or "category" in snapshots made from a
    profile), as JSON text: kept so the export gives back what the snapshot had. "" if none."""
    other = {k: v for k, v in d.items() if k not in keys and isinstance(k, str)}
    if not other:
        return ""
    try:
        return json.dumps(other)[:65536]
    except (TypeError, ValueError):
        return ""


def _int(v, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


class SnapshotConverter:
    """Turns snapshot dicts into table rows; owns the frame and stack tables (deduplicated
    across snapshots). Used by the writer thread only."""

    # Bounds on the deduplicated tables: beyond them new stacks are stored as "no frames"
    # (a run that keeps making new stacks, e.g. generated code, cannot grow the trace unbounded).
    MAX_FRAMES = 200_000
    MAX_STACKS = 200_000

    def __init__(self):
        self._frames: dict[tuple, int] = {}
        self._stacks: dict[tuple[int, ...], int] = {}
        self._stack_frames = 0  # rows in memory_stack_frames

    def _stack(self, frames, rows: dict) -> int:
        """Id of a stack (list of frame dicts), adding new frames and the stack to `rows`."""
        if not isinstance(frames, list):
            return -1
        ids = []
        for fr in frames:
            if not isinstance(fr, dict):
                continue
            key = (str(fr.get("filename", "")), _int(fr.get("line"), 0), str(fr.get("name", "")),
                   _mask(fr, FRAME_KEYS), _extra(fr, FRAME_KEYS))
            i = self._frames.get(key)
            if i is None:
                if len(self._frames) >= self.MAX_FRAMES:
                    return -1
                i = self._frames[key] = len(self._frames)
                rows["memory_frames"].append({"filename": key[0][:4096], "line": key[1], "name": key[2][:4096],
                                              "keys": key[3], "extra": key[4]})
            ids.append(i)
        key = tuple(ids)
        s = self._stacks.get(key)
        if s is None:
            if len(self._stacks) >= self.MAX_STACKS:
                return -1
            s = self._stacks[key] = len(self._stacks)
            rows["memory_stacks"].append({"first": self._stack_frames, "length": len(ids)})
            rows["memory_stack_frames"].extend({"frame": i} for i in ids)
            self._stack_frames += len(ids)
        return s

    def rows(self, snap: dict, snapshot: int, step: int, reason: str, time_s: float,
             device: int, allocated: int, reserved: int) -> dict[str, list[dict]]:
        rows: dict[str, list[dict]] = {t: [] for t in (
            "memory_snapshots", "memory_segments", "memory_blocks", "memory_trace", "memory_frames",
            "memory_stacks", "memory_stack_frames")}
        segments = snap.get("segments") or []
        for si, seg in enumerate(segments):
            pool = seg.get("segment_pool_id") or (0, 0)
            pool = tuple(pool) + (0, 0)
            rows["memory_segments"].append({
                "snapshot": snapshot, "device": _int(seg.get("device")), "address": _int(seg.get("address")),
                "total_size": _int(seg.get("total_size")), "allocated_size": _int(seg.get("allocated_size")),
                "active_size": _int(seg.get("active_size")), "requested_size": _int(seg.get("requested_size")),
                "stream": _int(seg.get("stream"), 0), "segment_type": str(seg.get("segment_type", "")),
                "pool_a": _int(pool[0], 0), "pool_b": _int(pool[1], 0),
                "is_expandable": int(bool(seg.get("is_expandable", False))),
                "stack": self._stack(seg.get("frames"), rows), "keys": _mask(seg, SEGMENT_KEYS),
                "extra": _extra(seg, SEGMENT_KEYS),
            })
            for b in seg.get("blocks") or []:
                rows["memory_blocks"].append({
                    "snapshot": snapshot, "segment": si, "address": _int(b.get("address")),
                    "size": _int(b.get("size"), 0), "requested_size": _int(b.get("requested_size")),
                    "state": str(b.get("state", "")), "stack": self._stack(b.get("frames"), rows),
                    "keys": _mask(b, BLOCK_KEYS), "extra": _extra(b, BLOCK_KEYS),
                })
        traces = snap.get("device_traces") or []
        for d, entries in enumerate(traces):
            for e in entries or []:
                rows["memory_trace"].append({
                    "snapshot": snapshot, "device": d, "action": str(e.get("action", "")),
                    "addr": _int(e.get("addr")), "device_free": _int(e.get("device_free")),
                    "size": _int(e.get("size"), 0), "stream": _int(e.get("stream"), 0),
                    "time_us": _int(e.get("time_us")),
                    "compile_context": str(e.get("compile_context", ""))[:1024],
                    "user_metadata": str(e.get("user_metadata", ""))[:1024],
                    "stack": self._stack(e.get("frames"), rows), "keys": _mask(e, TRACE_KEYS),
                    "extra": _extra(e, TRACE_KEYS),
                })
        settings = snap.get("allocator_settings")
        try:
            settings_json = json.dumps(settings) if settings is not None else ""
        except (TypeError, ValueError):
            settings_json = ""
        rows["memory_snapshots"].append({
            "snapshot": snapshot, "step": step, "reason": reason, "time_s": time_s, "device": device,
            "allocated_bytes": allocated, "reserved_bytes": reserved, "n_device_traces": len(traces),
            "allocator_settings": settings_json, "keys": _mask(snap, SNAPSHOT_KEYS),
            "extra": _extra(snap, SNAPSHOT_KEYS + ("segments",)),
        })
        return rows


_CPU_OOM = re.compile(r"you tried to allocate (\d+) bytes")
_CUDA_OOM = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError (torch.OutOfMemoryError), MemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def requested_bytes(message: str) -> int:
    """The size of the failed request, read from the allocator's message; -1 if it says none."""
    m = _CPU_OOM.search(message)
    if m:
        return int(m.group(1))
    m = _CUDA_OOM.search(message)
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    return -1


def raise_site(tb, limit: int = 8) -> str:
    """The innermost frames of a traceback, innermost last, as "file:line in function" lines."""
    frames = []
    while tb is not None:
        frames.append(f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}")
        tb = tb.tb_next
    return "\n".join(frames[-limit:])


class CudaMemoryRecorder:
    """Memory history, snapshots and the out-of-memory observer of one CUDA device.

    All torch.cuda calls here run on the training thread; the conversion of a snapshot into rows
    is a writer-thread task.
    """

    MAX_OOM_SNAPSHOTS = 3  # a job that catches OOM and retries smaller must not fill the disk

    def __init__(self, device: torch.device, history: bool, max_entries: int):
        self.device = device
        self.converter = SnapshotConverter()
        self.n_snapshots = 0
        self.n_oom_snapshots = 0
        self.started_history = False
        self.user_history = False
        if history:
            self._start_history(max_entries)

    def oom_slot(self) -> bool:
        """Whether an out-of-memory snapshot may still be taken (MAX_OOM_SNAPSHOTS), counted if so."""
        if self.n_oom_snapshots >= self.MAX_OOM_SNAPSHOTS:
            return False
        self.n_oom_snapshots += 1
        return True

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available() and hasattr(torch.cuda.memory, "_snapshot")

    def _start_history(self, max_entries: int) -> None:
        # A history the job records already (it called _record_memory_history itself): keep it,
        # do not restart it. torch says so directly where it can (_cuda_isHistoryEnabled); older
        # versions show it in a snapshot as history entries or as blocks with stacks.
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if enabled is not None:
            recording = bool(enabled())
        else:
            snap = torch.cuda.memory._snapshot()
            recording = any(snap.get("device_traces") or []) or any(
                b.get("frames") for s in snap.get("segments") or [] for b in s.get("blocks") or [])
        if recording:
            self.user_history = True
            return
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=max_entries)
        except TypeError:  # torch < 2.1: the legacy signature
            torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=max_entries,
                                                     trace_alloc_record_context=True)
        self.started_history = True

    def stop(self) -> None:
        if self.started_history:
            self.started_history = False
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except TypeError:
                torch.cuda.memory._record_memory_history(False)

    def take(self, step: int, reason: str):
        """Take a snapshot now; returns the writer task that stores it."""
        snap = torch.cuda.memory._snapshot()
        snapshot, self.n_snapshots = self.n_snapshots, self.n_snapshots + 1
        now = time.time()
        alloc, reserved, _ = cuda_bytes(self.device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        converter = self.converter

        def run(writer) -> dict:
            return converter.rows(snap, snapshot, step, reason, now, index, alloc, reserved)

        return snapshot, run

    def attach_oom_observer(self, callback) -> bool:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(callback)  # there is no detach: the callback checks whether recording is on
        return True
