"""torch.profiler windows on a sparse schedule, stored in the trace.

A window profiles `profile_steps` whole steps (CPU, and CUDA when the model is on a GPU; shapes
and memory recorded): the first starts at step `profile_first`, after warm-up, the next every
`profile_every` steps. The profiler is started and stopped at step boundaries, so no profiler run
ever spans more than its window. Turning its result into data — the Chrome trace (gzip) and a
table of operators — happens on the writer thread, not in the training loop.

torch.profiler is one per process (kineto's session is global): starting a second profiler while
one runs ends the first's session and opens its own, the first stop ends that one, and the
second's stop finds none: exporting its empty result crashed the job (exit 139, two models each
with a Recorder, at the end of their first window; measured on torch 2.13). So the
windows of all Recorders in a process take turns here, and a window never opens while the job's
own torch.profiler runs: a window due while the profiler is taken waits for the next step
boundary where it is free (oldest waiter first), and the trace says so (note()).

A window prints nothing: kineto's own log lines and the CPU allocator's warning about blocks
allocated before the window are held back (_quiet_kineto, _CppWarnings).
"""

from __future__ import annotations

import contextlib
import ctypes
import gzip
import json
import os
import sys
import tempfile
import time
import threading
import weakref

import numpy as np
import torch

# The process's one profiler, shared by every Recorder: who has it, and who waits for it.
_LOCK = threading.RLock()  # reentrant: a SIGTERM handler closing a Recorder may land inside begin()
_owner: "ProfilerWindows | None" = None
_queue: list = []  # weakrefs to windows due and waiting, oldest first: it opens first
_passes = 0  # step boundaries where the profiler was free but the oldest waiter did not come
# A waiter whose Recorder stopped stepping without closing would hold every other back: after
# this many passes anyone may take the free profiler.
_HEAD_PATIENCE = 16
_OTHER, _OWN = "another Recorder's profiler window was open or due first", "the job's own torch.profiler was running"
_NOTED = 8  # deferred windows listed in the trace's note (all are counted)


def _job_profiling() -> bool:
    """A torch.profiler or autograd profiler of the job itself runs (in any thread: the Python
    flag is process-wide; the C++ one is per thread)."""
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False)
                or torch._C._autograd._profiler_enabled())


def _head() -> "ProfilerWindows | None":
    while _queue:
        w = _queue[0]()
        if w is not None and w._due >= 0 and w.prof is None:
            return w
        del _queue[0]
    return None


def _leave_queue(w: "ProfilerWindows") -> None:
    _queue[:] = [r for r in _queue if r() is not None and r() is not w]


class ProfilerWindows:
    def __init__(self, first: int, steps: int, every: int, device: torch.device):
        self.first, self.steps, self.every = first, steps, every
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = None
        self.window = 0
        self._start_step = -1
        self._due = -1  # the step of a window due and not yet opened (the profiler was taken)
        self._window_due = -1  # the step the open window was due at
        self._why = ""
        self.deferred: list[tuple[int, int, str]] = []  # (due at, opened at, why): the first _NOTED that waited
        self.n_deferred = 0
        self.skipped = 0  # windows never opened: the next was due first, or the Recorder closed
        self.lost = 0  # windows whose result the job's own torch.profiler took (see end())
        self._quiet = _CppWarnings()

    def _starts_at(self, step: int) -> bool:
        return step == self.first or (step > self.first and (step - self.first) % self.every == 0)

    def begin(self, step: int) -> None:
        """Called when step `step` is about to run (end of the previous rec.step())."""
        global _owner, _passes
        if self.prof is not None or self.steps <= 0:
            return
        if self._starts_at(step):
            if self._due >= 0:  # still waiting for the last one: give it up for this one
                self.skipped += 1
            self._due = step
        if self._due < 0:
            return
        with _LOCK:
            head = _head() if _owner is None else None
            if _owner is not None:
                why = _OTHER
            elif _job_profiling():
                why = _OWN
            elif head is not None and head is not self and _passes < _HEAD_PATIENCE:
                _passes += 1
                why = _OTHER
            else:
                why = ""
            if why:
                self._why = why
                if not any(r() is self for r in _queue):
                    _queue.append(weakref.ref(self))
                return
            _leave_queue(self)
            _passes = 0
            prof = torch.profiler.profile(activities=self.activities, record_shapes=True, profile_memory=True)
            _owner = self
            try:
                self._quiet.hold()
                with _quiet_kineto():
                    prof.start()
            except BaseException:
                _owner = None
                self._quiet.release()
                raise
            self.prof = prof
        if self._due != step:
            self.n_deferred += 1
            if len(self.deferred) < _NOTED:
                self.deferred.append((self._due, step, self._why))
        self._window_due, self._due = self._due, -1
        self._start_step = step

    def end(self, step: int):
        """Called at rec.step(step): returns a task for the writer thread when a window closed."""
        if self.prof is None or step < self._start_step + self.steps - 1:
            return None
        prof = self.prof
        self._stop()
        # A torch.profiler the job started inside the window took over the session (starting one
        # ends the running one): this stop then got nothing, and exporting that empty result
        # crashes the process. Dropped, and counted.
        try:
            if prof.profiler.kineto_results.trace_start_ns() == 0:
                self.lost += 1
                return None
        except Exception:  # (a private API: where it is missing, export as before)
            pass
        window, self.window = self.window, self.window + 1
        return _task(prof, window, self._start_step, step, self._window_due)

    def _stop(self) -> None:
        """Stop this window's profiler and hand the process's profiler back."""
        global _owner
        prof, self.prof = self.prof, None
        try:
            prof.stop()
        finally:
            self._quiet.release()
            with _LOCK:
                if _owner is self:
                    _owner = None

    def abort(self) -> None:
        with _LOCK:
            _leave_queue(self)
            if self._due >= 0:
                self.skipped += 1
                self._due = -1
        if self.prof is not None:
            self._stop()

    def note(self) -> dict:
        """Trace attributes saying which windows waited for the profiler or never opened."""
        if not self.n_deferred and not self.skipped and not self.lost:
            return {}
        parts = []
        if self.n_deferred:
            whys = sorted({why for *_, why in self.deferred})
            shown = ", ".join(f"{d} to {o}" for d, o, _ in self.deferred)
            parts.append(f"{self.n_deferred} profiler window(s) deferred (from step {shown}"
                         f"{', ...' if self.n_deferred > len(self.deferred) else ''}): {' or '.join(whys)}")
        if self.skipped:
            parts.append(f"{self.skipped} profiler window(s) skipped: the profiler was still taken when "
                         "the next was due, or the recording ended first")
        if self.lost:
            parts.append(f"{self.lost} profiler window(s) lost: the job started its own torch.profiler during them")
        return {"profile_note": "; ".join(parts) + " (torch.profiler runs one at a time in a process)"}


@contextlib.contextmanager
def _quiet_kineto():
    """kineto (torch.profiler's engine) prints "profiler_start"/"profiler_stop" (USDT level, 5,
    above ERROR) and "Completed Stage" lines (older torch) on stderr at every start and stop;
    torch only lowers its level to ERROR. It reads KINETO_LOG_LEVEL once, when the process's first
    profiler starts (lazily, not at import: measured on torch 2.13), so it is set during that
    start, above every level (6), unless the job set it itself, and taken away afterwards so the
    job's child processes do not inherit it. A job that ran torch.profiler before the first
    window has kineto set up already: its level (and lines) stay as they were."""
    if "KINETO_LOG_LEVEL" in os.environ or _quiet_kineto.done:
        yield
        return
    _quiet_kineto.done = True
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        if os.environ.get("KINETO_LOG_LEVEL") == "6":
            del os.environ["KINETO_LOG_LEVEL"]


_quiet_kineto.done = False


class _CppWarnings:
    """Hold back c10's C++ WARNING log lines while a window is open.

    With profile_memory, freeing a tensor allocated before the window prints "[W...
    CPUAllocator.cpp] Memory block of unknown size was allocated before the profiling started"
    (once, then every 1000th time): every window frees the previous step's tensors. c10 has no
    API for its log level, only the variable TORCH_CPP_LOG_LEVEL sets at import,
    FLAGS_caffe2_log_level in libc10; it is raised from WARNING (1, the default) to ERROR (2) for
    the window and put back after, and left alone where the job chose another level or the
    library's symbol cannot be found (Windows: C++ names are mangled). Python warnings and
    logging, and C++ errors, are not affected; TORCH_WARN from Python calls becomes Python
    warnings, not c10 log lines."""

    _level = None  # ctypes.c_int over FLAGS_caffe2_log_level, False where not found
    _WARNING, _ERROR = 1, 2

    def __init__(self):
        self._held = False

    @classmethod
    def _flag(cls):
        if cls._level is None:
            cls._level = False
            name = {"linux": "libc10.so", "darwin": "libc10.dylib"}.get(sys.platform)
            path = os.path.join(os.path.dirname(torch.__file__), "lib", name) if name else None
            if path and os.path.exists(path):
                try:  # the library torch already loaded: dlopen returns the same one
                    cls._level = ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
                except (OSError, ValueError):
                    pass
        return cls._level

    def hold(self) -> None:
        flag = self._flag()
        if flag is not False and flag.value == self._WARNING:
            flag.value, self._held = self._ERROR, True

    def release(self) -> None:
        if self._held:
            self._held = False
            flag = self._flag()
            if flag.value == self._ERROR:  # (unless something else changed it meanwhile)
                flag.value = self._WARNING


def _task(prof, window: int, start: int, end: int, due: int):
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
        ops = [{"window": window, **row} for row in op_table(window_events(prof, data))]
        return {
            # (step_due: when it was due, if it had to wait; a column once the table has one)
            "profile_windows": {"window": window, "step_start": start, "step_end": end, "step_due": due,
                                "trace_offset": offset, "trace_nbytes": len(blob), "exported_unix": time.time()},
            "profile_ops": ops,
        }

    return run


_CPU = ("cpu_op", "user_annotation")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def window_events(prof, trace_json: bytes) -> list[tuple]:
    """A window's events as tuples: ("cpu", name, thread, start_us, dur_us, link), ("dev", name,
    dur_us, link) for a kernel or copy, ("mem", thread, time_us, bytes, on_device); `link` ties a
    device event to the CPU operator that launched it.

    From the profiler's own kineto events (~30 ms for the small transformer's 11k events); if
    this torch lacks them, from the exported Chrome trace (json.loads alone: ~230 ms)."""
    try:
        out = []
        for e in prof.profiler.kineto_results.events():
            name = e.name()
            on_cpu = e.device_type() == torch.autograd.DeviceType.CPU
            if name == "[memory]":
                out.append(("mem", e.start_thread_id(), e.start_ns() / 1e3, int(e.nbytes()), not on_cpu))
            elif on_cpu:
                if not e.is_python_function():
                    out.append(("cpu", name, e.start_thread_id(), e.start_ns() / 1e3, e.duration_ns() / 1e3,
                                e.correlation_id()))
            else:
                out.append(("dev", name, e.duration_ns() / 1e3, e.linked_correlation_id()))
        return out
    except Exception:  # (a private API: fall back on the documented export)
        pass
    out = []
    for e in json.loads(trace_json).get("traceEvents", []):
        cat, ph, args = e.get("cat"), e.get("ph"), e.get("args") or {}
        if ph == "X" and cat in _CPU:
            out.append(("cpu", str(e.get("name", "?")), e.get("tid"), float(e.get("ts", 0.0)),
                        float(e.get("dur", 0.0)), args.get("External id")))
        elif ph == "X" and cat in _DEVICE:
            out.append(("dev", str(e.get("name", "?")), float(e.get("dur", 0.0)), args.get("External id")))
        elif ph == "i" and e.get("name") == "[memory]":
            out.append(("mem", e.get("tid"), float(e.get("ts", 0.0)), int(args.get("Bytes", 0)),
                        bool(args.get("Device Type", 0))))
    return out


def op_table(events: list[tuple]) -> list[dict]:
    """Operators of a profiler window (window_events): calls, CPU time (self: without the
    operators called inside; total), device time, memory allocated (self).

    What torch.profiler's key_averages() gives (the same numbers on the small transformer), in
    one sweep: key_averages() took 0.6-0.7 s per window there (measured). CPU operators nest
    by time on their thread; a memory event counts for the innermost operator running then; a
    kernel or copy on the device is its own row (its device time is its self time) and adds its
    time to the operator that launched it."""
    rows: dict[str, list] = {}

    def row(name: str) -> list:
        r = rows.get(name[:512])
        if r is None:
            r = rows[name[:512]] = [0, 0.0, 0.0, 0.0, 0.0, 0, 0]  # calls, cpu self/total, dev self/total, mem
        return r

    cpu, launched, items = [], {}, []
    for e in events:
        if e[0] == "cpu":
            items.append((str(e[2]), e[3], 0, -e[4], len(cpu)))
            cpu.append(e)
        elif e[0] == "dev":
            r = row(e[1])
            r[0] += 1
            r[3] += e[2]
            r[4] += e[2]
            if e[3] is not None:
                launched[e[3]] = launched.get(e[3], 0.0) + e[2]
        else:
            items.append((str(e[1]), e[2], 1, 0.0, e))
    # One sweep per thread over operators (outer before inner at equal start) and memory events.
    items.sort(key=lambda t: t[:4])
    child = [0.0] * len(cpu)
    stack: list[tuple[float, int]] = []  # (end, operator) of the operators open on this thread
    tid = None
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
            r = row(cpu[stack[-1][1]][1])
            r[6 if k[4] else 5] += k[3]
    for k, e in enumerate(cpu):
        r = row(e[1])
        r[0] += 1
        r[1] += max(0.0, e[4] - child[k])
        r[2] += e[4]
        r[4] += launched.get(e[5], 0.0) if e[5] is not None else 0.0
    return [{"name": name, "calls": r[0], "cpu_self_us": r[1], "cpu_total_us": r[2], "device_self_us": r[3],
             "device_total_us": r[4], "cpu_memory_bytes": r[5], "device_memory_bytes": r[6]}
            for name, r in rows.items()]
