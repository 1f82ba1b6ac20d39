"""Older traces: every dataset added to the format after its first traces, and what it reads as in
a trace recorded before it existed. The one place the reader knows old formats: the readers
(table_reads.py, rank.py) fill a column a trace lacks from here, so nothing after them asks
which version wrote a file. A dataset added later is listed here with docs/trace_format.md's
versions table; an absent table that is not listed reads as empty (an optional table)."""

from __future__ import annotations

import numpy as np

# dataset -> what each of its rows reads as where the trace lacks it: a value, or a function of
# the table's other columns (read already) for a value an older trace implies.
ADDED = {
    # steps/: the census, garbage collection, the step's time split (schema 1, later)
    **dict.fromkeys(("steps/live_tensors", "steps/live_tensor_bytes", "steps/live_tensors_with_graph"), -1),
    **dict.fromkeys(("steps/between_steps_s", "steps/data_wait_s", "steps/forward_s", "steps/backward_s",
                     "steps/recorder_s", "steps/gc_s"), np.nan),
    "steps/gc_gen2": -1,
    # The optimizer's schedule (schema 2, later): not recorded.
    "steps/lr": np.nan,
    "steps/loss_scale": np.nan,
    "steps/optimizer_steps": -1,
    "steps/nonfinite_consumer": -1,  # the module that made a -Inf a fault
    "steps/loss_given": -1,  # 1 if rec.step() was given a loss; -1: not said
    "steps/output_grad_nonfinite": -1,  # the gradient at the model's outputs held NaN/Inf
    "steps/local_grad_norm": np.nan,  # a DDP rank's own gradient norm before the all-reduce
    "steps/grads_kept": -1,
    "steps/train_mode": -1,  # the model's mode at the step's forward passes: not seen
    "steps/nograd_train_forwards": -1,
    # The batch's statistics: not measured.
    **dict.fromkeys(("steps/input_min", "steps/input_max", "steps/input_mean", "steps/input_std",
                     "steps/input_zero_share", "steps/input_nonfinite_share", "steps/input_std_ratio"), np.nan),
    "steps/input_constant_features": -1,  # whether the optimizer step used the previous step's gradient tensors
    "params/shards": 1,  # FSDP2: before it, every parameter was whole on its rank
    "census_groups/grad_fn": b"",  # the op that made a census group's tensors: unknown
    "module_outputs/grad_fn": b"",
    **dict.fromkeys(("modules/class_source", "modules/forward_source"), b""),  # where the code is: unknown
    "memory_snapshots/extra": b"",  # the allocator snapshot's other keys: none kept
    "profile_windows/exported_unix": np.nan,  # when the writer exported the window: not said
    # Schema 1 watched every step of an activity window.
    "activity/steps_watched": lambda t: np.asarray(t["step_end"]) - np.asarray(t["step_start"]) + 1,
}


def added(name: str) -> bool:
    """Whether dataset ``name`` is one older traces may lack and the reader fills in."""
    return name in ADDED


def column(name: str, n: int, table: dict | None = None) -> np.ndarray:
    """Dataset ``name`` as an older trace reads: ``n`` rows (``table``: the table's other
    columns, for a value they imply). Read-only, like every column the reader returns."""
    fill = ADDED[name]
    out = np.asarray(fill(table)[:n]) if callable(fill) else np.full(n, fill)
    out.flags.writeable = False
    return out


def step_columns() -> tuple[str, ...]:
    """The columns of steps/ that were added after the first traces, in order."""
    return tuple(k.removeprefix("steps/") for k in ADDED if k.startswith("steps/"))
