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
import os
import sys
import tempfile
import time
import threading
import weakref

import numpy as np
import torch

from ..forward.wrapped_functions import compiling
from ..probe import Probe, StepPlan
from ..trace_file.schema import OWN_WORK_RANGE
from .op_table import op_table, window_events

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


_NO_RANGE = contextlib.nullcontext()


def own_work():
    """A profiler range around the recorder's own work while one of its windows is open (nothing
    otherwise: a range costs ~2 us): op_table() folds what runs inside it into one row, so the
    recorder's norms and copies are not listed as the job's slowest operators."""
    if compiling() or _owner is None:  # (compiling() first: Dynamo must not guard on _owner)
        return _NO_RANGE
    return torch.profiler.record_function(OWN_WORK_RANGE)


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


class ProfilerWindows(Probe):
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
        self._exported: list = []  # profilers whose window the writer has exported (see _release())
        self._quiet = _CppWarnings()

    # -- the probe protocol (probe.py) --------------------------------------------------------
    def arm(self, plan: StepPlan) -> None:
        self.begin(plan.step)

    def align(self, step: int) -> None:
        """Windows start after this attempt's warm-up; a window opened (or due) at the first step
        was labelled 0: it is the window of ``step``."""
        self.first += step
        if self._start_step >= 0:
            self._start_step = max(self._start_step, step)
        if self._window_due >= 0:
            self._window_due = max(self._window_due, step)
        if self._due >= 0:
            self._due = max(self._due, step)

    def close(self) -> None:
        self.abort()

    def _starts_at(self, step: int) -> bool:
        return step == self.first or (step > self.first and (step - self.first) % self.every == 0)

    def begin(self, step: int) -> None:
        """Called when step `step` is about to run (end of the previous rec.step())."""
        global _owner, _passes
        self._release()
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
        return _task(prof, window, self._start_step, step, self._window_due, self._exported)

    def _release(self) -> None:
        """Free the results of exported windows now, on the training thread at a step boundary.
        torch.profiler.profile holds its own bound methods (a reference cycle), so its results
        (~5 MB of small blocks for a small CNN) would wait for a full GC; meanwhile they cut
        glibc's free heap into pieces smaller than an activation, and every later step took its
        activations from the heap's top and gave them back (benchmarks/README.md, glibc)."""
        while self._exported:
            self._exported.pop().profiler = None

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


def _task(prof, window: int, start: int, end: int, due: int, exported: list):
    """What the writer thread runs: the window's rows and its gzipped Chrome trace. Then `prof`
    goes to `exported`, for the training thread to free its results (ProfilerWindows._release)."""

    def run(writer) -> dict:
        try:
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
        finally:
            exported.append(prof)
        return {
            # (step_due: when it was due, if it had to wait; a column once the table has one)
            "profile_windows": {"window": window, "step_start": start, "step_end": end, "step_due": due,
                                "trace_offset": offset, "trace_nbytes": len(blob), "exported_unix": time.time()},
            "profile_ops": ops,
        }

    return run
