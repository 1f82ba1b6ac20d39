"""The phases of a training step and the words findings and reports use for them, in one place
for the detectors, the cross-rank detectors and the report sections.

A step runs between_steps (the loop's own code, the DataLoader's `data` wait inside it), the
forward, the backward (and the optimizer step) and rec.step(); the heartbeat says which one a rank
was in, the per-step tables time them (steps/<phase>_s)."""

from __future__ import annotations

PHASES = ("between_steps", "data", "forward", "backward", "recorder")  # in the order a step runs them

# Where a rank's time went (the straggler: "... slower in {SPENT_IN[phase]}").
SPENT_IN = {"data": "waiting for its data (DataLoader)", "between_steps": "work between steps",
            "forward": "the forward pass", "backward": "backward and optimizer"}

# Where a rank stopped (the hang: "stopped in {STOPPED_IN[phase]}"; unknown: at the start).
STOPPED_IN = {"between_steps": "start", "data": "data loading", "forward": "forward",
              "backward": "backward (or optimizer step)", "recorder": "rec.step()"}

# The step's time split as every step records it (the DataLoader's wait is a part of the first).
TIMED = ("between_steps_s", "forward_s", "backward_s", "recorder_s")
TIMED_NAMES = {"between_steps_s": "between steps (data loading and other loop code)", "forward_s": "forward",
               "backward_s": "backward and optimizer", "recorder_s": "recorder"}
