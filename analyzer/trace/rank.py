"""One rank's trace (``rank{N}.h5``), read lazily: the per-step tables, the sampled ones, the
windows and sites, and the per-step digest.

RankTrace is put together from mixins, one module each: the low-level readers (table_reads.py),
the call-site tables (site_tables.py), the CUDA memory tables (memory_tables.py) and the stored
tensors (stored_tensors.py); the per-step table is read through StepColumns (step_columns.py)."""

from __future__ import annotations

import os
import re
from functools import cached_property

import h5py
import numpy as np
import pandas as pd

from ..errors import SchemaVersionError, TraceFormatError
from . import schema, upgrade
from .format import (measured_rows, module_label, ACTIVATION_STATS, FORMAT_NAME, MODULE_STATS, PARAM_STATS,
                     SCHEMA_VERSION, UNMEASURED_IS_NEGATIVE,
                     _PER_STEP_TABLES, _attr, _open, _strings, parse_json, rank_of_file)
from .liveness import Liveness
from .training_setup import TrainingSetup
from .memory_tables import MemoryTables
from .site_tables import SiteTables
from .step_columns import NOT_MEASURED_IS_MINUS_ONE, STEP_COLUMNS, StepColumns
from .stored_tensors import StoredTensors
from .streaming import StepDigest, early_to_late, weight_thirds
from .table_reads import TableReads

__all__ = ["STEP_COLUMNS", "RankTrace", "StepColumns"]


def _shape(text: str) -> tuple[int, ...]:
    shape = parse_json(text)
    if not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 2**53 for d in shape):
        raise ValueError(f"a parameter shape reads {text[:40]!r}")
    return tuple(shape)


class RankTrace(TableReads, SiteTables, MemoryTables, StoredTensors, Liveness, TrainingSetup):
    """One rank's trace, read lazily; every DataFrame it returns is read-only."""

    def __init__(self, path: str):
        self.path = path
        self.size_bytes = os.path.getsize(path)
        with _open(path) as f:
            meta = {k: _attr(v, lines=k == "model_summary") for k, v in f.attrs.items()}
            if meta.get("format") != FORMAT_NAME:
                raise TraceFormatError(f"{path} is an HDF5 file but not a torchautopsy trace "
                                       "(no format attribute 'torchautopsy-trace')")
            version = meta.get("schema_version")
            if not isinstance(version, int) or isinstance(version, bool):
                raise TraceFormatError(f"{path} has no valid schema_version attribute")
            if version > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"{path} uses trace schema {version}, newer than this torchautopsy reads "
                    f"({SCHEMA_VERSION}); upgrade: pip install -U torchautopsy")
            try:
                lists = {f"{t}/{c}": f[f"{t}/{c}"].shape[0] if f[f"{t}/{c}"].ndim == 1 else -1
                         for t, cs in (("params", ("name", "shape", "numel")),
                                       ("modules", ("name", "type", "is_leaf"))) for c in cs}
                schema.check_names(path, lists)
                self.param_names = _strings(f["params/name"])
                self.param_shapes = [_shape(s) for s in _strings(f["params/shape"])]
                self.param_numel = np.asarray(schema.numeric(path, "params/numel", f["params/numel"][()]),
                                              dtype=np.int64)
                # Into how many shards each parameter is split (FSDP2): its figures here are those
                # of this rank's shard (analyzer/trace/shards.py combines them).
                shards = f["params/shards"][()] if "params/shards" in f else \
                    upgrade.column("params/shards", len(self.param_names))
                shards = np.asarray(schema.numeric(path, "params/shards", shards), dtype=np.int64)
                if shards.shape != (len(self.param_names),) or (shards < 1).any():
                    raise ValueError("params/shards is not one count >= 1 per parameter")
                self.param_shards = shards
                self.module_names = _strings(f["modules/name"])
                self.module_labels = [module_label(n) for n in self.module_names]  # the frames' columns
                self.module_types = _strings(f["modules/type"])
                self.module_is_leaf = np.asarray(f["modules/is_leaf"][()], dtype=bool)
                # Where each module's code is (recorder/trace_file/module_sources.py): "path:line" of its class and
                # its forward, "" where not known (older traces, a damaged column).
                self.module_class_source, self.module_forward_source = (
                    _sources(f, f"modules/{c}", len(self.module_names)) for c in ("class_source", "forward_source"))
                schema.check_step_table(path, f, _PER_STEP_TABLES, {"params": len(self.param_names),
                                                                    "modules": len(self.module_names)})
                # A killed writer may have resized some datasets of a table and not yet others:
                # the steps that are complete are those every per-step dataset holds.
                self.n_steps = min(f[f"{t}/{c}"].shape[0] for t, cols in _PER_STEP_TABLES.items() for c in cols)
                schema.check_step_count(path, self.n_steps)
                schema.check_step_numbers(path, f["steps/step"][:self.n_steps])
            except (KeyError, OSError, ValueError, TypeError) as e:
                raise TraceFormatError(f"{path} is a torchautopsy trace with missing or damaged "
                                       f"parts ({e}); it cannot be analyzed") from None
        self.meta = schema.clean_meta(meta)
        self.rank = self.meta.get("rank", rank_of_file(path))  # the file's name, if the attribute is unusable

    # -- views --------------------------------------------------------------------------------
    @property
    def closed_cleanly(self) -> bool:
        return bool(self.meta.get("closed", False))

    @cached_property
    def step_index(self) -> np.ndarray:
        return self._read("steps/step", self.n_steps)

    @cached_property
    def columns(self) -> "StepColumns":
        """The per-step table as the analyzer reads it: a column at a time (``rt.columns["loss"]``
        is a Series by step), each read from the file when asked for and not kept (a million steps
        hold 8 MB a column, not 130 MB), "not measured" as the file holds it (-1, NaN)."""
        return StepColumns(self)

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per step, indexed by step: the columns of steps/ in the file's order (time_s,
        loss, loss_given, rss_bytes, cuda_*_bytes, the step's time split (*_s), ..., lr,
        loss_scale, optimizer_steps, ...: docs/trace_format.md). What was not measured on a step
        is NaN; nonfinite_origin and nonfinite_consumer are module indices (-1: none)."""
        df = self.columns.frame()
        for col in NOT_MEASURED_IS_MINUS_ONE:
            df[col] = df[col].where(df[col] != -1).astype(np.float64)
        return df

    def _step_column(self, col: str) -> np.ndarray:
        name = f"steps/{col}"
        if upgrade.added(name) and not self._has(name):
            return upgrade.column(name, self.n_steps)
        data = self._read(name, self.n_steps)
        if len(data) < self.n_steps:  # a kill can leave a later column a row short
            short = self.n_steps - len(data)
            pad = upgrade.column(name, short) if upgrade.added(name) else np.full(short, np.nan)
            data = np.concatenate([data, pad.astype(data.dtype)])
        return data

    def param_stat(self, stat: str, rows=None) -> pd.DataFrame:
        """Steps x parameters: grad_norm, grad_absmax, grad_nonfinite or param_norm; of every
        step, or of ``rows`` only (a slice or row indices, see ``rows_in_span``)."""
        if stat not in PARAM_STATS:
            raise ValueError(f"unknown parameter statistic {stat!r}; one of {PARAM_STATS}")
        idx, data = self._read_rows(f"params/{stat}", rows, self.n_steps)
        return self._frame(data, self.step_index[idx], self.param_names, f"params/{stat}")

    def module_stat(self, stat: str = "output_absmax") -> pd.DataFrame:
        """Watched steps x modules: max |output| per step, a row for each step whose modules were
        watched (NaN/Inf where the output was; -1 where the module did not run on that step).
        The root module's column is '(model)'."""
        frame = self.module_rows(stat)
        return frame[measured_rows(frame.to_numpy())]

    def module_rows(self, stat: str = "output_absmax", rows=None) -> pd.DataFrame:
        """Steps x modules, every step (``rows``: those rows): as module_stat, -1 also on every
        step that was not watched (the detectors' view)."""
        if stat not in MODULE_STATS:
            raise ValueError(f"unknown module statistic {stat!r}; one of {MODULE_STATS}")
        idx, data = self._read_rows(f"modules/{stat}", rows, self.n_steps)
        return self._frame(data, self.step_index[idx], self.module_labels, f"modules/{stat}")

    def activation_stat(self, stat: str, rows=None) -> pd.DataFrame:
        """Sampled steps x modules: mean, std, absmax, zero_frac or nonfinite of each output
        (``rows``: of the samples). The root module's column is '(model)'."""
        if stat not in ACTIVATION_STATS:
            raise ValueError(f"unknown activation statistic {stat!r}; one of {ACTIVATION_STATS}")
        steps = self._sampled_steps("activations", ACTIVATION_STATS)
        idx, data = self._read_rows(f"activations/{stat}", rows, len(steps))
        return self._frame(data, steps[idx], self.module_labels, f"activations/{stat}")

    def update_ratio(self, rows=None) -> pd.DataFrame:
        """Sampled steps x parameters: ||w_after - w_before|| / ||w_before|| of that step's update
        (``rows``: of the samples). The root module's column is '(model)'."""
        steps = self._sampled_steps("updates", ("ratio",))
        idx, data = self._read_rows("updates/ratio", rows, len(steps))
        return self._frame(data, steps[idx], self.param_names, "updates/ratio")

    def sample_steps(self, table: str) -> np.ndarray:
        """The steps of a sampled table's rows (activations, updates); empty if absent."""
        cols = {"activations": ACTIVATION_STATS, "updates": ("ratio",)}.get(table, ())
        return self._sampled_steps(table, cols) if self._has(f"{table}/step") else np.zeros(0, np.int64)

    def n_samples(self, table: str) -> int:
        """Rows of a sampled table (activations, updates, attention); 0 if absent."""
        return len(self.sample_steps(table))

    def holds(self, name: str) -> bool:
        """Whether the file itself holds dataset ``name``: what a detector needs before it says it
        checked the trace (a column upgrade.py fills in for an older trace reads as "not measured")."""
        return self._has(name)

    def lacks(self, name: str) -> bool:
        """Whether the trace lacks dataset ``name`` (e.g. "steps/lr") and the reader cannot fill it
        in (upgrade.py: datasets added after the first traces read as "not measured")."""
        return not upgrade.added(name) and not self._has(name)

    @cached_property
    def census_groups(self) -> pd.DataFrame:
        """Live tensor census by group, one row per (census step, group): step, device, dtype,
        shape (str), graph (holds an autograd graph), grad_fn (the graph's last op, e.g.
        ReluBackward0; "" without a graph or in older traces), count, bytes."""
        texts = ("device", "dtype", "shape", "grad_fn")
        cols = ("step", "device", "dtype", "shape", "graph", "count", "bytes", "grad_fn")
        df = self._texts_table("census_groups", cols, texts)
        key = ["step", "device", "dtype", "shape", "graph", "grad_fn"]
        # One row per group and step, as the recorder writes them; a damaged trace's repeats are summed.
        return df.groupby(key, as_index=False, sort=False)[["count", "bytes"]].sum()[key + ["count", "bytes"]]

    @cached_property
    def loss_checks(self) -> dict[int, dict]:
        """The loss function on the first steps that went NaN/Inf, by step: outputs_nonfinite (1:
        the model's outputs held NaN/Inf on the step itself, 0: finite, -1: not known) and ops
        (the loss's autograd op names from the loss to the outputs; None: not found). Empty in
        older traces."""
        t = self._texts_table("loss_checks", ("step", "outputs_nonfinite", "ops"), ("ops",))
        checks = {}
        for step, outs, text in zip(t["step"], t["outputs_nonfinite"], t["ops"]):
            try:
                step = int(step)
            except (ValueError, OverflowError):  # a damaged row
                continue
            ops = parse_json(text)
            ok = isinstance(ops, list) and all(isinstance(o, str) for o in ops)
            checks.setdefault(step, {"outputs_nonfinite": int(outs) if outs in (0, 1) else -1,
                                          "ops": ops[:64] if ok else None})
        return checks

    @cached_property
    def profile_windows(self) -> pd.DataFrame:
        """torch.profiler windows: window, step_start, step_end, trace_offset, trace_nbytes, and
        exported_unix (when the writer had exported it; absent from older traces)."""
        cols = ("window", "step_start", "step_end", "trace_offset", "trace_nbytes", "exported_unix")
        return pd.DataFrame(self._table("profile_windows", cols))

    def profile_ops(self, window: int | None = None) -> pd.DataFrame:
        """Operators of one profiler window (or all, with a ``window`` column), slowest first:
        name, calls, cpu_self_us, cpu_total_us, device_self_us, device_total_us, memory."""
        cols = ("window", "name", "calls", "cpu_self_us", "cpu_total_us", "device_self_us",
                "device_total_us", "cpu_memory_bytes", "device_memory_bytes")
        df = self._texts_table("profile_ops", cols, ("name",))
        if window is not None:
            df = df[df["window"] == window]
        return df.sort_values(["window", "cpu_self_us"], ascending=[True, False]).reset_index(drop=True)

    def profile_trace(self, window: int) -> bytes:
        """The Chrome trace (JSON bytes, as torch.profiler exported it) of one window; bounded
        (profile_blob.py): a window that unpacks past 100x its size raises TraceFormatError."""
        from .profile_blob import profile_chunks

        return b"".join(profile_chunks(self, window))

    @cached_property
    def digest(self) -> StepDigest:
        """Per-step series over all parameters, from one streaming pass (see StepDigest)."""
        d = StepDigest(self.n_steps, len(self.param_names))
        if not self.param_names:
            return d
        bad_blocks = self.blocks("params/grad_nonfinite")
        w_blocks = self.blocks("params/param_norm")
        thirds = weight_thirds(self.param_shapes)
        if thirds:
            weights, early, late = thirds
            numel = self.param_numel[weights].astype(np.float64)
        for (a, g32), (_, bad), (_, w) in zip(self.blocks("params/grad_norm"), bad_blocks, w_blocks):
            counted = bad > 0
            present = ~np.isnan(g32) | counted
            sq = g32.astype(np.float64)
            sq *= sq
            np.copyto(sq, 0.0, where=~present)
            with np.errstate(invalid="ignore", over="ignore"):
                tot = np.sqrt(sq.sum(axis=1))
            b = slice(a, a + len(g32))
            d.grad_absent[b] = ~present.any(axis=1)
            tot[d.grad_absent[b]] = np.nan
            d.total_grad_norm[b] = tot
            d.grad_nonfinite[b] = counted.any(axis=1)
            d.param_nonfinite[b] = ~np.isfinite(w).all(axis=1)
            d.grad_steps += np.count_nonzero(present, axis=0)
            d.grad_zero_steps += np.count_nonzero(g32 == 0, axis=0)  # (a gradient of 0 is present)
            measured = w >= 0  # (-1: not measured; NaN fails too)
            wf = w if w.dtype.kind == "f" else w.astype(np.float64)  # (a damaged trace's integers)
            d.norm_min = np.minimum(d.norm_min, wf.min(axis=0, where=measured, initial=np.inf))
            d.norm_max = np.maximum(d.norm_max, wf.max(axis=0, where=measured, initial=-np.inf))
            if thirds:
                d.early_to_late[b], d.weight_grads[b] = early_to_late(g32, weights, numel, early, late)
        # A step AMP's GradScaler skipped: its NaN/Inf gradients are the overflow of the scaled
        # fp16 backward, never applied; the scaler's job, not a failure (loss_scale detector).
        skipped = self.amp_skipped
        if skipped.any():
            d.grad_nonfinite[skipped] = False
            d.total_grad_norm[skipped] = np.nan
        for arr in vars(d).values():
            arr.flags.writeable = False
        return d

    @cached_property
    def amp_skipped(self) -> np.ndarray:
        """Per step: the GradScaler skipped it (a loss scale recorded, no optimizer step ran)."""
        skipped = (self._step_column("optimizer_steps") == 0) & np.isfinite(self._step_column("loss_scale"))
        skipped.flags.writeable = False
        return skipped

    @cached_property
    def hyperparams(self) -> pd.DataFrame:
        """The optimizers' hyper-parameters as recorded: a row (step, optimizer, group, name,
        value) when first seen and whenever one changed; a value holds until its next row. Empty
        for traces recorded before schema 2 held them. ``steps["lr"]`` has the first group's
        learning rate at every step."""
        return self._texts_table("hyperparams", ("step", "optimizer", "group", "name", "value"), ("name",))

    @cached_property
    def optimizers(self) -> pd.DataFrame:
        """The model's optimizers, in the order first seen: optimizer (index), class, first_step."""
        return self._texts_table("optimizers", ("optimizer", "class", "first_step"), ("class",))

    @cached_property
    def total_grad_norm(self) -> pd.Series:
        """L2 norm of all gradients together, per step (NaN/Inf when any gradient was)."""
        return pd.Series(self.digest.total_grad_norm, index=pd.Index(self.step_index, name="step"),
                         name="total_grad_norm")

    def bucketed(self, name: str, edges: np.ndarray, cols=None) -> dict[str, np.ndarray]:
        """Reduce a per-step steps x tensors dataset over buckets of rows, streaming.

        ``edges``: increasing row indices, bucket k = rows edges[k]:edges[k+1]; ``cols``: column
        indices (default all). Returns buckets x cols arrays: ``max`` and ``min`` of the finite
        values (NaN where none), ``nonfinite`` (some value NaN/Inf), ``inf`` (some value +-Inf),
        ``positive_max`` (the largest finite value > 0, NaN where none: for log scales). In
        the datasets where -1 means "not measured" (format.UNMEASURED_IS_NEGATIVE) those
        entries are skipped.
        """
        unmeasured = name in UNMEASURED_IS_NEGATIVE
        edges = np.unique(np.asarray(edges, dtype=np.int64))
        nb = len(edges) - 1
        width = len(cols) if cols is not None else None
        out = None
        for a, block in self.blocks(name, start=int(edges[0]) if nb > 0 else 0,
                                    stop=int(edges[-1]) if nb > 0 else 0):
            v = np.asarray(block if cols is None else block[:, cols], dtype=np.float64)
            if out is None:
                width = v.shape[1]
                out = {k: np.full((nb, width), np.nan) for k in ("max", "min", "positive_max")}
                out["nonfinite"] = np.zeros((nb, width), dtype=bool)
                out["inf"] = np.zeros((nb, width), dtype=bool)
            # The buckets this block touches, and where each starts inside the block.
            k0 = int(np.searchsorted(edges, a, "right")) - 1
            k1 = int(np.searchsorted(edges, a + len(v), "left"))
            ks = np.arange(k0, k1)
            starts = np.maximum(edges[k0:k1] - a, 0)
            finite = np.isfinite(v)
            fv = np.where(finite, v, np.nan)
            if unmeasured:  # -1: not measured (or module not called) on that step
                fv[fv < 0] = np.nan
            with np.errstate(invalid="ignore"):
                hi = np.fmax.reduceat(fv, starts, axis=0)
                lo = np.fmin.reduceat(fv, starts, axis=0)
                pos = np.fmax.reduceat(np.where(fv > 0, fv, np.nan), starts, axis=0)
            bad = np.logical_or.reduceat(~finite, starts, axis=0)
            out["inf"][ks] |= np.logical_or.reduceat(np.isinf(v), starts, axis=0)
            out["max"][ks] = np.fmax(out["max"][ks], hi)
            out["min"][ks] = np.fmin(out["min"][ks], lo)
            out["positive_max"][ks] = np.fmax(out["positive_max"][ks], pos)
            out["nonfinite"][ks] |= bad
        if out is None:
            width = width or 0
            out = {k: np.full((nb, width), np.nan) for k in ("max", "min", "positive_max")}
            out["nonfinite"] = np.zeros((nb, width), dtype=bool)
            out["inf"] = np.zeros((nb, width), dtype=bool)
        return out

    @property
    def wall_time_s(self) -> float:
        t = self.columns["time_s"].to_numpy()
        if t.size == 0:
            return 0.0
        return float(t[-1] - self.meta.get("start_unix", t[0]))


_SOURCE = re.compile(r"[^\x00-\x1f\x7f]{1,400}:[0-9]{1,7}")


def _sources(f, name: str, n: int) -> list[str]:
    """A column of "path:line" texts, one per module; "" for any that is not one."""
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset) or ds.shape != (n,) or ds.dtype.kind not in "OS":
        return [""] * n
    return [t if _SOURCE.fullmatch(t) else "" for t in _strings(ds)]
