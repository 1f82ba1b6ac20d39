"""torch.profiler windows on a sparse schedule, stored in the trace.

A window profiles `profile_steps` whole steps (CPU, and CUDA when the model is on a GPU; shapes
and memory recorded): the first starts at step `profile_first`, after warm-up, the next every
`profile_every` steps. The profiler is started and stopped at step boundaries, so no profiler run
ever spans more than its window. Turning its result into data — the Chrome trace (gzip) and a
table of operators — happens on the writer thread, not in the training loop.
"""

from __future__ import annotations

import gzip
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
                blob = gzip.compress(f.read(), compresslevel=9)
        finally:
            os.unlink(path)
        offset = writer.append_blob(np.frombuffer(blob, dtype=np.uint8))
        ops = []
        for e in prof.key_averages():
            ops.append({
                "window": window,
                "name": str(e.key)[:512],
                "calls": int(e.count),
                "cpu_self_us": float(e.self_cpu_time_total),
                "cpu_total_us": float(e.cpu_time_total),
                "device_self_us": float(getattr(e, "self_device_time_total", 0.0) or 0.0),
                "device_total_us": float(getattr(e, "device_time_total", 0.0) or 0.0),
                "cpu_memory_bytes": int(e.self_cpu_memory_usage),
                "device_memory_bytes": int(getattr(e, "self_device_memory_usage", 0) or 0),
            })
        return {
            "profile_windows": {"window": window, "step_start": start, "step_end": end,
                                "trace_offset": offset, "trace_nbytes": len(blob)},
            "profile_ops": ops,
        }

    return run
