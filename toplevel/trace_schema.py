"""The trace's per-step tables as data: the one place a per-step column is spelled.

The recorder writes from it (recorder/trace_file/schema.py's table_layout), the analyzer reads by it
(analyzer/trace/upgrade.py fills what older traces lack, format.py and step_columns.py know
which values mean "not measured"), and the tests build traces from it (tests/tracebuilder.py);
tests/analyzer/test_trace_schema_doc.py holds docs/trace_format.md to it. Adding a column is
one line below plus its row in the doc.

It imports nothing but the stdlib: the recorder (torch, no pandas), the analyzer (no torch) and
torch-free tests all import it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Schema 2 made module outputs, weight norms and gradient max |g| "measured on watched steps
# only" (-1 elsewhere) and added activity/steps_watched; see the doc's Versions table.
SCHEMA_VERSION = 2
FORMAT_NAME = "torchautopsy-trace"

NAN = float("nan")
ORIGINAL = "original"  # `since` of a column the first traces already had
ONE, PER_PARAM, PER_MODULE = "one", "params", "modules"  # width: a value a row, or one per tensor


@dataclass(frozen=True)
class StepColumn:
    table: str  # steps, params or modules: one row per step, rows aligned
    name: str
    dtype: str  # numpy dtype string
    width: str  # ONE, PER_PARAM (params/name order) or PER_MODULE (modules/name order)
    # The value meaning "not measured" (readers show NaN for it or skip it); None where every
    # value is a reading (nonfinite_origin's -1 is "no module", not a missing reading).
    not_measured: float | int | None
    since: int | str  # ORIGINAL, or the schema version whose traces first held it
    # What a trace recorded before the column existed reads as (None for ORIGINAL columns).
    older: float | int | None = None
    # What a step where nothing happened holds, where that is not `not_measured` (0 NaN/Inf
    # elements, no loss given); the trace builder's and the synthetic trace's default.
    quiet: float | int | None = None

    @property
    def path(self) -> str:
        return f"{self.table}/{self.name}"

    @property
    def fill(self):
        """What a step holds that measured nothing and saw nothing happen (None: a column every
        step writes, as step and time_s)."""
        return self.not_measured if self.quiet is None else self.quiet


_c = StepColumn  # (short, for the one-line rows below)
# In the order the recorder creates them. Meanings: docs/trace_format.md, "Per-step tables".
PER_STEP: tuple[StepColumn, ...] = (
    _c("steps", "step", "i8", ONE, None, ORIGINAL),
    _c("steps", "time_s", "f8", ONE, None, ORIGINAL),
    _c("steps", "loss", "f8", ONE, NAN, ORIGINAL),  # NaN: none given (or a NaN loss: loss_given)
    _c("steps", "loss_given", "i1", ONE, -1, 2, older=-1, quiet=0),
    _c("steps", "rss_bytes", "i8", ONE, -1, ORIGINAL),
    _c("steps", "cuda_allocated_bytes", "i8", ONE, -1, ORIGINAL),  # -1: no CUDA
    _c("steps", "cuda_reserved_bytes", "i8", ONE, -1, ORIGINAL),
    _c("steps", "cuda_peak_bytes", "i8", ONE, -1, ORIGINAL),
    _c("steps", "between_steps_s", "f4", ONE, NAN, 1, older=NAN),  # the step's time split
    _c("steps", "data_wait_s", "f4", ONE, NAN, 1, older=NAN),
    _c("steps", "forward_s", "f4", ONE, NAN, 1, older=NAN),
    _c("steps", "backward_s", "f4", ONE, NAN, 1, older=NAN),
    _c("steps", "recorder_s", "f4", ONE, NAN, 1, older=NAN),
    _c("steps", "nonfinite_origin", "i4", ONE, None, ORIGINAL, quiet=-1),  # a module index; -1: none
    _c("steps", "batch_nonfinite", "i1", ONE, None, ORIGINAL, quiet=0),
    _c("steps", "nonfinite_consumer", "i4", ONE, None, 2, older=-1, quiet=-1),  # a module index
    _c("steps", "output_grad_nonfinite", "i1", ONE, -1, 2, older=-1),
    _c("steps", "live_tensors", "i8", ONE, -1, 1, older=-1),  # the census, on census steps only
    _c("steps", "live_tensor_bytes", "i8", ONE, -1, 1, older=-1),
    _c("steps", "live_tensors_with_graph", "i8", ONE, -1, 1, older=-1),
    _c("steps", "gc_s", "f4", ONE, NAN, 1, older=NAN),
    _c("steps", "gc_gen2", "i4", ONE, -1, 1, older=-1),
    _c("steps", "lr", "f8", ONE, NAN, 2, older=NAN),
    _c("steps", "loss_scale", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "optimizer_steps", "i4", ONE, -1, 2, older=-1),
    _c("steps", "local_grad_norm", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "grads_kept", "i1", ONE, -1, 2, older=-1),
    _c("steps", "train_mode", "i1", ONE, -1, 2, older=-1),
    _c("steps", "nograd_train_forwards", "i4", ONE, -1, 2, older=-1),
    _c("steps", "input_min", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "input_max", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "input_mean", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "input_std", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "input_zero_share", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "input_nonfinite_share", "f4", ONE, NAN, 2, older=NAN),
    _c("steps", "input_constant_features", "i4", ONE, -1, 2, older=-1),
    _c("steps", "input_std_ratio", "f4", ONE, NAN, 2, older=NAN),
    _c("params", "grad_norm", "f4", PER_PARAM, None, ORIGINAL, quiet=NAN),  # NaN: no gradient
    _c("params", "grad_absmax", "f4", PER_PARAM, -1, ORIGINAL),  # -1: not watched (schema 2)
    _c("params", "grad_nonfinite", "i4", PER_PARAM, None, ORIGINAL, quiet=0),
    _c("params", "param_norm", "f4", PER_PARAM, -1, ORIGINAL),
    _c("modules", "output_absmax", "f4", PER_MODULE, -1, ORIGINAL),
)
del _c

PER_STEP_TABLES = ("steps", "params", "modules")


def columns(table: str) -> tuple[StepColumn, ...]:
    """The per-step columns of ``table``, in the recorder's order."""
    return tuple(c for c in PER_STEP if c.table == table)


def added() -> dict[str, float | int]:
    """Every per-step dataset the first traces lacked, and what it reads as in a trace without it."""
    return {c.path: c.older for c in PER_STEP if c.since != ORIGINAL}


def minus_one_not_measured(table: str) -> tuple[str, ...]:
    """Columns of ``table`` where -1 in the file means "not measured"."""
    return tuple(c.name for c in columns(table) if c.not_measured == -1)
