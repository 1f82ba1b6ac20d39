"""RankTrace's readers of the CUDA allocator snapshots and out-of-memory events (optional
tables: absent from CPU runs and older traces, where they read as empty)."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pandas as pd

from ..errors import TraceFormatError
from .format import _texts


class MemoryTables:
    """Mixed into RankTrace: needs its ``_table`` and ``_texts_table``."""

    # -- CUDA allocator snapshots and out-of-memory events (optional tables) --------------------
    @cached_property
    def memory_snapshots(self) -> pd.DataFrame:
        """CUDA allocator snapshots: snapshot, step, reason (schedule, peak, oom, exception),
        time_s, device, allocated_bytes, reserved_bytes, n_device_traces, allocator_settings
        (JSON text), keys, extra (JSON text of the snapshot's other keys; "" in traces older
        than it). Empty for CPU runs and older traces."""
        cols = ("snapshot", "step", "reason", "time_s", "device", "allocated_bytes", "reserved_bytes",
                "n_device_traces", "allocator_settings", "keys", "extra")
        return self._texts_table("memory_snapshots", cols, ("reason", "allocator_settings", "extra"))

    def memory_snapshot_rows(self, snapshot: int) -> dict[str, pd.DataFrame]:
        """One snapshot's rows: {"segments", "blocks", "trace"} DataFrames, in recorded order
        (columns as docs/trace_format.md lists them; ``stack`` indexes memory_stack)."""
        tables = {
            "segments": ("memory_segments", ("snapshot", "device", "address", "total_size", "allocated_size",
                                             "active_size", "requested_size", "stream", "segment_type", "pool_a",
                                             "pool_b", "is_expandable", "stack", "keys", "extra"), ("segment_type", "extra")),
            "blocks": ("memory_blocks", ("snapshot", "segment", "address", "size", "requested_size", "state",
                                         "stack", "keys", "extra"), ("state", "extra")),
            "trace": ("memory_trace", ("snapshot", "device", "action", "addr", "device_free", "size", "stream",
                                       "time_us", "compile_context", "user_metadata", "stack", "keys", "extra"),
                      ("action", "compile_context", "user_metadata", "extra")),
        }
        out = {}
        for key, (table, cols, texts) in tables.items():
            t = self._table(table, cols, texts)
            sel = np.flatnonzero(np.asarray(t["snapshot"]) == snapshot)
            df = pd.DataFrame({c: np.asarray(t[c])[sel] for c in cols})
            for c in texts:
                df[c] = _texts(df[c])
            out[key] = df.reset_index(drop=True)
        return out

    @cached_property
    def _memory_stacks(self) -> tuple[list[dict], np.ndarray, np.ndarray, np.ndarray]:
        f = self._texts_table("memory_frames", ("filename", "line", "name", "keys", "extra"),
                              ("filename", "name", "extra"))
        frames = [{"filename": a, "line": int(b), "name": c, "keys": int(k), "extra": x}
                  for a, b, c, k, x in zip(f["filename"], f["line"], f["name"], f["keys"], f["extra"])]
        st = self._table("memory_stacks", ("first", "length"))
        sf = np.asarray(self._table("memory_stack_frames", ("frame",))["frame"], dtype=np.int64)
        first, length = np.asarray(st["first"], dtype=np.int64), np.asarray(st["length"], dtype=np.int64)
        # Each stack is its own run of memory_stack_frames: together they hold at most its rows
        # (fewer where a kill cut the table). Overlapping runs would let a small file expand into
        # a huge snapshot (every entry naming a stack of a million frames): refused.
        lo, hi = np.clip(first, 0, len(sf)), np.clip(first + np.maximum(length, 0), 0, len(sf))
        if (first < 0).any() or (length < 0).any() or int(np.maximum(hi - lo, 0).sum()) > len(sf):
            raise TraceFormatError(f"{self.path}: memory_stacks point outside memory_stack_frames or "
                                   "overlap; the trace is damaged")
        return frames, first, length, sf

    def memory_stack(self, stack: int) -> list[dict] | None:
        """The frames of a stack (dicts with filename, line, name, and ``keys``: which of those
        the snapshot had), innermost first as PyTorch records them; None for stack -1."""
        frames, first, length, sf = self._memory_stacks
        if stack < 0 or stack >= len(first):
            return None
        ids = sf[first[stack]:first[stack] + length[stack]]
        return [frames[i] for i in ids if 0 <= i < len(frames)]

    @cached_property
    def oom_events(self) -> pd.DataFrame:
        """Times memory ran out: step, time_s, source (observer: the CUDA allocator's; exception:
        an out-of-memory error left the Recorder's with-block), device, requested_bytes,
        device_allocated_bytes, device_reserved_bytes, device_free_bytes, device_total_bytes (-1:
        unknown), rss_bytes, snapshot, message, raised_at."""
        cols = ("step", "time_s", "source", "device", "requested_bytes", "device_allocated_bytes",
                "device_reserved_bytes", "device_free_bytes", "device_total_bytes", "rss_bytes", "snapshot",
                "message", "raised_at")
        return self._texts_table("oom_events", cols, ("source", "device", "message", "raised_at"))

    @cached_property
    def oom_tensor_groups(self) -> pd.DataFrame:
        """The tensor census taken when memory ran out: event, device, dtype, shape, graph, count, bytes."""
        cols = ("event", "device", "dtype", "shape", "graph", "count", "bytes")
        df = self._texts_table("oom_tensor_groups", cols, ("device", "dtype", "shape"))
        # (newer traces split a group by the graph's last op: summed here, as before)
        return df.groupby(list(cols[:5]), as_index=False, sort=False)[["count", "bytes"]].sum()[list(cols)]
