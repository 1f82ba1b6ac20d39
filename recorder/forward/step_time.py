"""Where a step's time went: waiting for data (wrapped_functions.py times DataLoader.__next__), between
steps, the forward (the root module's hooks, root_hooks.py), backward and optimizer (the forward's
end to rec.step()), and the recorder's own work. NaN where a phase was not seen (no forward, the
first step, no DataLoader)."""

from __future__ import annotations

import math
import time


class StepClock:
    def __init__(self):
        self.t_step_end: float | None = None  # when the last rec.step() returned
        self.t_forward_start: float | None = None  # the step's first forward began (perf_counter)
        self.t_forward_end: float | None = None  # its last forward ended
        self.data_wait_s = 0.0  # time in DataLoader.__next__ since the last rec.step()
        self.saw_loader = False

    def on_forward_start(self) -> None:
        if self.t_forward_start is None:
            self.t_forward_start = time.perf_counter()

    def on_forward_end(self) -> None:
        self.t_forward_end = time.perf_counter()

    def on_data_wait(self, seconds: float) -> None:
        self.data_wait_s += seconds
        self.saw_loader = True

    def split(self, t_called: float) -> tuple:
        """(data_wait_s, between_steps_s, forward_s, backward_s, recorder_s) of the step ending at
        rec.step() (called at t_called); starts the next step's clock."""
        prev, now = self.t_step_end, time.perf_counter()
        t_forward, t_forward_end = self.t_forward_start, self.t_forward_end
        self.t_step_end = now
        self.t_forward_start = self.t_forward_end = None
        wait = self.data_wait_s if self.saw_loader else math.nan
        self.data_wait_s = 0.0
        return (wait,
                t_forward - prev if (t_forward is not None and prev is not None) else math.nan,
                t_forward_end - t_forward if (t_forward is not None and t_forward_end is not None) else math.nan,
                t_called - t_forward_end if t_forward_end is not None else math.nan,
                now - t_called)
