"""The heartbeat: what the training thread is doing when steps stop coming (a hang, a stall).

A daemon thread wakes every ``heartbeat_s`` seconds. While steps come, it writes nothing (the
steps table shows the job alive). When no rec.step() came since its last wake, it writes a row:
the time, the step in progress, its phase (waiting for data, forward, backward and optimizer, the
recorder's own work, or between steps) and for how long. Once the step in progress has taken far
longer than usual (``stall_factor`` times the typical step, and at least two heartbeats), the row
also holds the training thread's Python stack, sampled with ``sys._current_frames()`` (no signal,
nothing injected: the training thread is never touched). A job stuck in a collective is blocked
in C code that released the GIL, so this thread still runs; a job killed then by a timeout leaves
its last rows, which the writer flushes every ``flush_every_s``.

The phase is read from what the recorder's hooks already keep (the forward's start and end,
DataLoader.__next__, rec.step()): nothing is added to a step."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

from ..forward import wrapped_functions

MAX_FRAMES = 40  # innermost frames kept of a stack sample
_EMA = 0.2  # weight of the newest interval in the typical step time


def phase_of(in_step_since: float | None, clock) -> tuple[str, float | None]:
    """(phase, when it began on the perf_counter clock, or None) of the training thread now:
    ``in_step_since`` when rec.step() is running, else what the step's clock (forward/step_time.py)
    and the DataLoader's timing (forward/wrapped_functions.py) saw."""
    if in_step_since is not None:
        return "recorder", in_step_since
    since = wrapped_functions.loader_since()
    if since is not None:
        return "data", since
    start, end = clock.t_forward_start, clock.t_forward_end
    if start is not None and end is None:
        return "forward", start
    if end is not None:
        return "backward", end
    return "between_steps", clock.t_step_end


def stack_of(thread_id: int) -> str:
    """The thread's Python stack as JSON [[file, line, function, code], ...], innermost last."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame)[-MAX_FRAMES:]
    return json.dumps([[f.filename, f.lineno or 0, f.name, (f.line or "")[:200]] for f in frames])


class Heartbeat:
    def __init__(self, *, step_now, active, phase, step_began, put_task, every_s: float, stall_factor: float):
        """Callables, read from the heartbeat's thread: ``step_now()`` the step in progress,
        ``active()`` whether the recorder still records, ``phase()`` phase_of's (phase, since),
        ``step_began()`` when the step in progress began (perf_counter, or None), and
        ``put_task`` the writer's."""
        self._step_now, self._active, self._phase = step_now, active, phase
        self._step_began, self._put_task = step_began, put_task
        self.every_s = every_s
        self.stall_factor = stall_factor
        self._thread_id = threading.get_ident()  # the training thread: the one that made the Recorder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchautopsy-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread and wait for it to end (it wakes at once), so that no thread of ours
        is left for the interpreter's shutdown. Bounded: a SIGTERM handler may call this while
        the training thread it interrupted holds a lock the heartbeat waits for."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        seen_step, seen_at, seen_end = self._step_now(), time.perf_counter(), None
        typical = None  # seconds per step, between the ends of steps seen by the heartbeat
        last_stack = None
        while not self._stop.wait(self.every_s):
            try:
                now = time.perf_counter()
                step = self._step_now()
                if step != seen_step:
                    end = self._step_began()
                    if seen_end is not None and end is not None and end > seen_end:
                        per_step = (end - seen_end) / max(1, step - seen_step)
                        typical = per_step if typical is None else (1 - _EMA) * typical + _EMA * per_step
                    seen_step, seen_at, seen_end, last_stack = step, now, end, None
                    continue
                if not self._active():
                    return
                phase, since = self._phase()
                step_began = self._step_began()
                step_s = now - step_began if step_began is not None else now - seen_at
                if step_s < max(self.every_s, 2 * typical if typical else 0.0):
                    continue  # (a slow step, not yet overdue: steps longer than a heartbeat write nothing)
                stall_after = max(2 * self.every_s, self.stall_factor * typical if typical else 0.0)
                stack = ""
                if step_s >= stall_after:
                    sampled = stack_of(self._thread_id)
                    if sampled != last_stack:  # (a stack that did not change is written once)
                        stack = last_stack = sampled
                row = {"time_unix": time.time(), "step": step, "phase": phase,
                       "phase_s": now - since if since is not None else float("nan"),
                       "step_s": step_s, "typical_step_s": typical if typical else float("nan"), "stack": stack}
                self._put_task(lambda _w, row=row: {"heartbeats": row})
            except Exception:  # (the heartbeat never disturbs the job; the trace just lacks its rows)
                return
