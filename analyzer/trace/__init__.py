"""Read a run directory of torchautopsy traces (one ``rank{N}.h5`` per rank).

This package is the only place that knows the file layout (docs/trace_format.md) and its
versions. It never imports torch, never unpickles, and never executes anything from a trace.

    format.py          constants, opening a rank file (also one a killed job left open), strings
    streaming.py       block reads, chosen rows, the per-step digest
    rank.py            RankTrace: one rank's per-step, sampled and windowed tables
    step_columns.py    StepColumns: the per-step table read a column at a time; its columns
    table_reads.py     low-level dataset and table readers, checked (mixed into RankTrace)
    site_tables.py     activity, attention and module-output call sites (mixed into RankTrace)
    memory_tables.py   CUDA allocator snapshots and out-of-memory events (mixed into RankTrace)
    stored_tensors.py  snapshots, samples, the black box, histograms (mixed into RankTrace)
    run_dir.py         Trace and load(): a run directory, one RankTrace per rank

    run = load("runs/exp1")
    rt = run.ranks[0]
    rt.steps                      # DataFrame by step: loss, time, memory, lr, ... (not measured: NaN)
    rt.columns["loss"]            # one per-step column, read alone (as the analyzer reads them)
    rt.param_stat("grad_norm")    # DataFrame, steps x parameter names (the whole run)
    rt.param_stat("grad_norm", rows=slice(-100, None))   # only the last 100 steps
    for start, block in rt.blocks("params/grad_norm"): ...  # the whole run, a block at a time

The analyzer streams: a steps x tensors statistic of a long run (a million steps x 200 tensors is
800 MB a statistic) is never read whole. Detectors and reports read it in blocks of rows
(``blocks``), read the rows they need (``rows=``), or use the per-step digest (``digest``, one
pass over the parameter statistics); memory is bounded by the number of tensors, plus a few
bytes per step for the 1-D per-step series.
"""

from .format import (ACTIVATION_STATS, FORMAT_NAME, HIST_KINDS, MODULE_STATS, PARAM_STATS,
                     SCHEMA_VERSION, UNMEASURED_IS_NEGATIVE, measured_rows)
from .rank import STEP_COLUMNS, RankTrace, StepColumns
from .run_dir import Trace, load, trace_files
from .streaming import StepDigest, block_rows

__all__ = ["ACTIVATION_STATS", "FORMAT_NAME", "HIST_KINDS", "MODULE_STATS", "PARAM_STATS", "SCHEMA_VERSION",
           "STEP_COLUMNS", "UNMEASURED_IS_NEGATIVE", "RankTrace", "StepColumns", "StepDigest", "Trace",
           "block_rows", "load", "measured_rows", "trace_files"]
