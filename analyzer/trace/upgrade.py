"""Older traces: every dataset added to the format after its first traces, and what it reads as in
a trace recorded before it existed. The one place the reader knows old formats: the readers
(table_reads.py, rank.py) fill a column a trace lacks from here, so nothing after them asks
which version wrote a file. A dataset added later is listed here with docs/trace_format.md's
versions table (a per-step column: in torchautopsy/trace_schema.py, whence it comes here); an
absent table that is not listed reads as empty (an optional table)."""

from __future__ import annotations

import numpy as np

from ... import trace_schema

# dataset -> what each of its rows reads as where the trace lacks it: a value, or a function of
# the table's other columns (read already) for a value an older trace implies.
ADDED = {
    # The per-step tables' columns added after the first traces: torchautopsy/trace_schema.py.
    **trace_schema.added(),
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
