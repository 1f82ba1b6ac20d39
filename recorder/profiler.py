"""torch.profiler windows on a sparse schedule, stored in the trace.

A window profiles `profile_steps` whole steps (CPU, and CUDA when the model is on a GPU; shapes
and memory recorded): the first starts at step `profile_first`, after warm-up, the next every
`profile_every` steps. The profiler is started and stopped at step boundaries, so no profiler run
ever spans more than its window. Turning its result into data — the Chrome trace (gzip) and a
table of operators — happens on the writer thread, not in the training loop.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile

import numpy as np
import torch


class ProfilerWindows:
    def __init__(self, first: int, steps: int, every: int, device: torch.device):
        self.first, self.steps, self.every = first, steps, every
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = None
        self.window = 0
        self._start_step = -1

    def _starts_at(self, step: int) -> bool:
        return step == self.first or (step > self.first and (step - self.first) % self.every == 0)

    def begin(self, step: int) -> None:
        """Called when step `step` is about to run (end of the previous rec.step())."""
        if self.prof is None and self.steps > 0 and self._starts_at(step):
            self.prof = torch.profiler.profile(activities=self.activities, record_shapes=True,
                                               profile_memory=True)
            self.prof.start()
            self._start_step = step

    def end(self, step: int):
        """Called at rec.step(step): returns a task for the writer thread when a window closed."""
        if self.prof is None or step < self._start_step + self.steps - 1:
            return None
        prof, self.prof = self.prof, None
        prof.stop()
        window, self.window = self.window, self.window + 1
        return _task(prof, window, self._start_step, step)

    def abort(self) -> None:
        if self.prof is not None:
            try:
                self.prof.stop()
            finally:
                self.prof = None


def _task(prof, window: int, start: int, end: int):
    """What the writer thread runs: the window's rows and its gzipped Chrome trace."""

    def run(writer) -> dict:
        fd, path = tempfile.mkstemp(suffix=".json", prefix="torchautopsy-profile-")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path, "rb") as f:
                data = f.read()
        finally:
            os.unlink(path)
        # Level 1: ~10x faster than 9 for ~1.6x the bytes (a 4.7 MB trace of the small
        # transformer: 11 ms and 409 KB, against 111 ms and 249 KB; measured).
        blob = gzip.compress(data, compresslevel=1)
        offset = writer.append_blob(np.frombuffer(blob, dtype=np.uint8))
        ops = [{"window": window, **row} for row in op_table(json.loads(data).get("traceEvents", []))]
        return {
            "profile_windows": {"window": window, "step_start": start, "step_end": end,
                                "trace_offset": offset, "trace_nbytes": len(blob)},
            "profile_ops": ops,
        }

    return run


_CPU = ("cpu_op", "user_annotation")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def op_table(events: list[dict]) -> list[dict]:
    """Operators of a profiler window, from its Chrome trace events: calls, CPU time (self:
    without the operators called inside; total), device time, memory allocated (self).

    What torch.profiler's key_averages() gives, in a single sweep over the events: that call
    took 0.6-0.7 s per window of the small transformer (measured), where this takes ~0.1 s. CPU
    operators nest by time on their thread; a memory event counts for the innermost operator
    running then; a kernel or copy on the device is its own row (its device time is its self
    time) and adds its time to the operator that launched it (same "External id")."""
    rows: dict[str, list] = {}

    def row(name: str) -> list:
        r = rows.get(name)
        if r is None:
            r = rows[name] = [0, 0.0, 0.0, 0.0, 0.0, 0, 0]  # calls, cpu self/total, dev self/total, mem
        return r

    cpu, marks, launched = [], [], {}
    for e in events:
        cat, ph = e.get("cat"), e.get("ph")
        if ph == "X" and cat in _CPU:
            cpu.append(e)
        elif ph == "X" and cat in _DEVICE:
            r = row(str(e.get("name", "?"))[:512])
            r[0] += 1
            r[3] += float(e.get("dur", 0.0))
            r[4] += float(e.get("dur", 0.0))
            ext = (e.get("args") or {}).get("External id")
            if ext is not None:
                launched[ext] = launched.get(ext, 0.0) + float(e.get("dur", 0.0))
        elif ph == "i" and e.get("name") == "[memory]":
            marks.append(e)
    # One sweep per thread over operators (outer before inner at equal start) and memory events.
    items = [(e.get("tid"), float(e.get("ts", 0.0)), 0, -float(e.get("dur", 0.0)), k) for k, e in enumerate(cpu)]
    items += [(e.get("tid"), float(e.get("ts", 0.0)), 1, 0.0, k) for k, e in enumerate(marks)]
    items.sort(key=lambda t: (str(t[0]), t[1], t[2], t[3]))
    child = [0.0] * len(cpu)
    stack: list[tuple[float, int]] = []  # (end, operator) of the operators open on this thread
    tid = object()
    for t, ts, kind, neg_dur, k in items:
        if t != tid:
            tid, stack = t, []
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if kind == 0:
            if stack:
                child[stack[-1][1]] += -neg_dur
            stack.append((ts - neg_dur, k))
        elif stack:
            args = marks[k].get("args") or {}
            r = row(str(cpu[stack[-1][1]].get("name", "?"))[:512])
            r[6 if args.get("Device Type", 0) else 5] += int(args.get("Bytes", 0))
    for k, e in enumerate(cpu):
        r = row(str(e.get("name", "?"))[:512])
        dur = float(e.get("dur", 0.0))
        r[0] += 1
        r[1] += max(0.0, dur - child[k])
        r[2] += dur
        dev = launched.get((e.get("args") or {}).get("External id"))
        if dev:
            r[4] += dev
    return [{"name": name, "calls": r[0], "cpu_self_us": r[1], "cpu_total_us": r[2], "device_self_us": r[3],
             "device_total_us": r[4], "cpu_memory_bytes": r[5], "device_memory_bytes": r[6]}
            for name, r in rows.items()]
