"""What the job's memory did, step by step: resident memory, the CUDA allocator's bytes and its
own record (history and snapshots, cuda_allocator.py), the census of live tensors (readings.py) on its
budget and at each new high, the time Python's garbage collector took, and running out of
memory (the allocator's observer, or an error leaving ``with Recorder(...)``).

The recorder asks it once a step (``read``) and tells it of an out-of-memory error; everything it
learns goes into the step's row or to the writer."""

from __future__ import annotations

import gc
import math
import time
import warnings
import weakref

import torch

from ..probe import Probe
from .cuda_allocator import CudaMemoryRecorder, raise_site, requested_bytes
from .readings import cuda_bytes, rss_bytes, tensor_census

# Resident memory is read again at a step once this long has passed since the last reading;
# faster steps repeat it. A reading is a system call on /proc: ~25 us right after a training
# step (measured), 0.13% of the 20 ms step of benchmarks/'s MLP; a leak or a peak shows the same.
RSS_EVERY_S = 0.1
_NO_CUDA = (-1, -1, -1)  # (allocated, reserved, peak) bytes of a step not on CUDA
_NO_CENSUS = (-1, -1, -1, [])  # a step without a census: (tensors, bytes, with graph, groups)


class MemoryProbe(Probe):
    def __init__(self, config, planner, on_fail):
        self.config = config
        self.planner = planner  # (the census's budget is against the median plain step)
        self._fail = on_fail
        self.writer = None
        self.cuda: CudaMemoryRecorder | None = None
        self._rss = -1  # the last reading of resident memory (RSS_EVERY_S), and when it was taken
        self._rss_at = -math.inf
        self._next_census = 0
        self._census_peak = 0  # the highest memory a census was taken at
        self._last_census = -(10**9)
        self._at_peak = False  # this step's memory is a new high (a census was taken for it)
        self._gc_s = 0.0  # time in Python's garbage collector since the last step
        self._gc_gen2 = 0
        self._gc_t0 = None
        self._gc_callback = None
        self._oom_events = 0
        self._oom_snapshot_step = -1

    def attach(self, device: torch.device, writer, on_cuda_oom) -> None:
        """Start the CUDA allocator's record (on a GPU; ``on_cuda_oom(device, alloc, total,
        free)`` is its out-of-memory observer) and the garbage collector's timing."""
        self.writer = writer
        if CudaMemoryRecorder.available(device):
            try:
                self.cuda = CudaMemoryRecorder(device, self.config.cuda_memory_history,
                                               self.config.cuda_history_entries)
                self.cuda.attach_oom_observer(on_cuda_oom)
            except Exception as e:
                self.cuda_off(e)
        self._attach_gc()

    def close(self) -> None:
        self.detach()

    def detach(self) -> None:
        if self._gc_callback is not None and self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        if self.cuda is not None:
            self.cuda.stop()

    def read(self, step: int, device: torch.device, t_called: float) -> tuple:
        """The step's memory: (CUDA allocated, reserved, peak bytes, resident bytes, live
        tensors, their bytes, how many hold a graph, the census's largest groups, seconds in the
        garbage collector, its full collections); the collector's counts start again."""
        alloc, reserved, peak = cuda_bytes(device) if device.type == "cuda" else _NO_CUDA
        if t_called - self._rss_at >= RSS_EVERY_S:
            self._rss, self._rss_at = rss_bytes(), t_called
        rss = self._rss
        census = self._census(step, alloc if alloc >= 0 else rss)
        gc_s, gc_gen2 = self._gc_s, self._gc_gen2
        self._gc_s, self._gc_gen2 = 0.0, 0
        return (alloc, reserved, peak, rss, *census, gc_s, gc_gen2)

    def _census(self, step: int, memory: int) -> tuple[int, int, int, list[dict]]:
        """Live tensor census on a sparse schedule that keeps its cost near census_budget of
        training (0.15%), and also when memory (CUDA allocated, else RSS) climbs to a new high: 10%
        and 64 MiB above the highest a census saw, at least 10 steps after the last one. So the
        trace knows what held the memory near its peak. Returns (live tensors, their bytes, how
        many hold a graph, the largest groups), -1s and no groups on the steps without one."""
        peak = (memory > 1.1 * self._census_peak and memory - self._census_peak > 64 * 2**20
                and step - self._last_census >= 10)
        self._at_peak = peak
        if step < self._next_census and not peak:
            return _NO_CENSUS
        self._census_peak = max(self._census_peak, memory)
        self._last_census = step
        t0 = time.perf_counter()
        n, nbytes, graphs, groups = tensor_census()
        self._next_census = max(self._next_census, step + self.planner.census_gap(time.perf_counter() - t0))
        return n, nbytes, graphs, groups

    def cuda_snapshot(self, step: int):
        """A snapshot of the CUDA allocator on its schedule or at a memory peak (the census's
        trigger), as a writer task; None on other steps."""
        cm, cfg = self.cuda, self.config
        if cm is None or cm.n_snapshots - cm.n_oom_snapshots >= cfg.cuda_snapshot_max:
            return None
        first, every = cfg.cuda_snapshot_first, cfg.cuda_snapshot_every
        scheduled = every > 0 and (step == first or (step > first and (step - first) % every == 0))
        if not (scheduled or self._at_peak):
            return None
        try:
            _, task = cm.take(step, "peak" if self._at_peak else "schedule")
        except Exception as e:
            self.cuda_off(e)
            return None
        return task

    def cuda_off(self, e: BaseException) -> None:
        """A failing snapshot or history turns them off, not the rest of the recording."""
        warnings.warn(f"torchautopsy: CUDA memory snapshots turned off ({type(e).__name__}: {e}); the rest "
                      "of the recording goes on", RuntimeWarning, stacklevel=3)
        cm, self.cuda = self.cuda, None
        if cm is not None:
            try:
                cm.stop()
            except Exception:
                pass

    def _attach_gc(self) -> None:
        """Time Python's garbage collector (gc.callbacks): a callback per collection, ~1 us."""
        ref = weakref.ref(self)

        def on_gc(phase, info):
            probe = ref()
            if probe is None:
                return
            if phase == "start":
                probe._gc_t0 = time.perf_counter()
            elif probe._gc_t0 is not None:
                probe._gc_s += time.perf_counter() - probe._gc_t0
                probe._gc_t0 = None
                if info.get("generation") == 2:
                    probe._gc_gen2 += 1

        self._gc_callback = on_gc
        gc.callbacks.append(on_gc)

    # -- running out of memory ----------------------------------------------------------------
    def _oom_snapshot(self, step: int, source: str) -> int:
        """A snapshot for an out-of-memory event (at most MAX_OOM_SNAPSHOTS in a run): its
        index, or -1."""
        cm = self.cuda
        if cm is None or not cm.oom_slot():
            return -1
        try:
            snapshot, task = cm.take(step, source)
            self.writer.put_task(task)
            return snapshot
        except Exception as e:
            self.cuda_off(e)
            return -1

    def on_cuda_oom(self, step: int, device, alloc, device_total, device_free) -> None:
        """The CUDA allocator's out-of-memory observer: called before it raises, with the state
        that made it fail still in place. Snapshot it and flush, as the job may die next.

        Its third argument is the device's total memory (or the allowed maximum under
        set_per_process_memory_fraction), whatever PyTorch's docs call it (CUDACachingAllocator.cpp
        passes `set_fraction ? allowed_memory_maximum : device_total`); allocated and reserved
        bytes are read from the allocator's counters, which its lock no longer holds by then."""
        if self.cuda is None:
            return
        try:
            snapshot = self._oom_snapshot(step, "oom")
            if snapshot >= 0:
                self._oom_snapshot_step = step
            allocated, reserved, _ = cuda_bytes(torch.device("cuda", int(device)))
            self.writer.put({"oom_events": {
                "step": step, "time_s": time.time(), "source": "observer", "device": f"cuda:{int(device)}",
                "requested_bytes": int(alloc), "device_allocated_bytes": allocated,
                "device_reserved_bytes": reserved,
                "device_free_bytes": int(device_free), "device_total_bytes": int(device_total),
                "rss_bytes": rss_bytes(), "snapshot": snapshot,
                "message": "", "raised_at": "",
            }})
            self._oom_events += 1
            self.writer.flush()
        except Exception as e:
            self._fail(e)

    def on_oom_exception(self, step: int, device: torch.device, exc: BaseException, tb) -> None:
        """An out-of-memory error leaving the `with Recorder(...)` block: what was live then (a
        census, and on CUDA a snapshot unless the observer took one for this step)."""
        try:
            message = f"{type(exc).__name__}: {exc}"
            cuda = device.type == "cuda" and ("CUDA" in message or "cuda" in message)
            snapshot = self._oom_snapshot(step, "exception") if cuda and self._oom_snapshot_step != step else -1
            alloc, reserved, _ = cuda_bytes(device) if cuda else (-1, -1, -1)
            _, _, _, groups = tensor_census()
            event = self._oom_events
            self._oom_events += 1
            self.writer.put({
                "oom_events": {
                    "step": step, "time_s": time.time(), "source": "exception",
                    "device": str(device) if cuda else "cpu", "requested_bytes": requested_bytes(message),
                    "device_allocated_bytes": alloc, "device_reserved_bytes": reserved, "device_free_bytes": -1,
                    "device_total_bytes": -1, "rss_bytes": rss_bytes(),
                    "snapshot": snapshot, "message": message[:4000], "raised_at": raise_site(tb)[:4000],
                },
                "oom_tensor_groups": [{"event": event, **g} for g in groups],
            })
        except Exception as e:
            self._fail(e)
