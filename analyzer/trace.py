"""Read a run directory of torchautopsy traces (one ``rank{N}.h5`` per rank).

This is the only place that knows the file layout (docs/trace_format.md) and its versions.
It never imports torch, never unpickles, and never executes anything from a trace.

    run = load("runs/exp1")
    rt = run.ranks[0]
    rt.steps                      # DataFrame, one row per step: loss, time, memory, ...
    rt.param_stat("grad_norm")    # DataFrame, steps x parameter names (the whole run)
    rt.param_stat("grad_norm", rows=slice(-100, None))   # only the last 100 steps
    for start, block in rt.blocks("params/grad_norm"): ...  # the whole run, a block at a time

The analyzer streams: a steps x tensors statistic of a long run (a million steps x 200 tensors is
800 MB a statistic) is never read whole. Detectors and reports read it in blocks of rows
(``blocks``), read the rows they need (``rows=``), or use the per-step digest (``digest``, one
pass over the parameter statistics); memory is bounded by the number of tensors, plus a few
bytes per step for the 1-D per-step series.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from functools import cached_property

import h5py
import numpy as np
import pandas as pd

from .errors import SchemaVersionError, TraceFormatError, TraceNotFoundError

SCHEMA_VERSION = 1
FORMAT_NAME = "torchautopsy-trace"
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_RANK_FILE = re.compile(r"^rank(\d+)\.h5$")

PARAM_STATS = ("grad_norm", "grad_absmax", "grad_nonfinite", "param_norm")
MODULE_STATS = ("output_absmax",)
ACTIVATION_STATS = ("mean", "std", "absmax", "zero_frac", "nonfinite")
HIST_KINDS = ("weight", "grad", "activation")
# Tables written once per step: their rows line up, one per step.
_PER_STEP_TABLES = {"steps": ("step",), "params": PARAM_STATS, "modules": MODULE_STATS}


def _open(path: str) -> h5py.File:
    """Open a trace read-only, also one whose writer was killed (SWMR-mode file left open)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise TraceFormatError(f"{path} is empty or truncated ({os.path.getsize(path)} bytes); "
                               "it holds no trace")
    if head != _HDF5_SIGNATURE:
        raise TraceFormatError(f"{path} is not an HDF5 file, so not a torchautopsy trace; "
                               "point at the run directory written by Recorder(model, run_dir)")
    try:
        return h5py.File(path, "r")
    except OSError as plain:
        message = str(plain)
    # A killed writer leaves its "open for write" flag set; SWMR readers accept that. Only then
    # do we retry in SWMR mode: on a damaged file an SWMR reader retries reads for a long time.
    if "already open for write" in message:
        try:
            return h5py.File(path, "r", swmr=True)
        except OSError as e:
            message = str(e)
    reason = message.split("(", 1)[-1].rstrip(")") if "(" in message else message
    raise TraceFormatError(f"{path} is truncated or corrupt (HDF5 says: {reason}); "
                           "copy it again from the job's run directory")


def _attr(v):
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        return v.item()
    return v


def _texts(values) -> list[str]:
    """UTF-8 strings as h5py returns them (bytes, or str) to str."""
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values]


def _strings(ds) -> list[str]:
    return _texts(ds[()])


# A block of rows read at a time holds about this many values (8 MB as float64), whatever the
# width of the table: wide enough for numpy to be fast, small enough to bound memory.
_BLOCK_VALUES = 1 << 20


# Activity windows read at a time (each is a few KB of bits).
_WINDOWS_PER_READ = 256


def block_rows(width: int) -> int:
    """Rows per block for a table ``width`` values wide."""
    return int(np.clip(_BLOCK_VALUES // max(int(width), 1), 256, 1 << 17))


def _row_selection(rows, n: int) -> np.ndarray | slice:
    """A slice stays a slice (clipped to the n rows present); anything else becomes sorted
    unique row indices, negative ones counted from the end."""
    if isinstance(rows, slice):
        return slice(*rows.indices(n))
    idx = np.asarray(rows, dtype=np.int64).ravel()
    idx = np.where(idx < 0, idx + n, idx)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"row index out of range (the table has {n} rows)")
    return np.unique(idx)


class StepDigest:
    """Per-step 1-D series computed in one pass over the parameter statistics.

    total_grad_norm    L2 norm of all gradients together (NaN: no gradient; Inf/NaN when one was)
    grad_nonfinite     some gradient held NaN/Inf (counts, not norms: an Inf norm may be overflow)
    grad_absent        no parameter had a gradient (every norm NaN, none counted non-finite)
    param_nonfinite    some weight norm was NaN/Inf (the weights themselves went non-finite)
    """

    def __init__(self, n: int):
        self.total_grad_norm = np.full(n, np.nan)
        self.grad_nonfinite = np.zeros(n, dtype=bool)
        self.grad_absent = np.ones(n, dtype=bool)
        self.param_nonfinite = np.zeros(n, dtype=bool)


class RankTrace:
    """One rank's trace, read lazily; every DataFrame it returns is read-only."""

    def __init__(self, path: str):
        self.path = path
        self.size_bytes = os.path.getsize(path)
        with _open(path) as f:
            meta = {k: _attr(v) for k, v in f.attrs.items()}
            if meta.get("format") != FORMAT_NAME:
                raise TraceFormatError(f"{path} is an HDF5 file but not a torchautopsy trace "
                                       "(no format attribute 'torchautopsy-trace')")
            version = meta.get("schema_version")
            if not isinstance(version, int):
                raise TraceFormatError(f"{path} has no valid schema_version attribute")
            if version > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"{path} uses trace schema {version}, newer than this torchautopsy reads "
                    f"({SCHEMA_VERSION}); upgrade: pip install -U torchautopsy")
            try:
                self.param_names = _strings(f["params/name"])
                self.param_shapes = [tuple(json.loads(s)) for s in _strings(f["params/shape"])]
                self.param_numel = np.asarray(f["params/numel"][()], dtype=np.int64)
                self.module_names = _strings(f["modules/name"])
                self.module_types = _strings(f["modules/type"])
                self.module_is_leaf = np.asarray(f["modules/is_leaf"][()], dtype=bool)
                # A killed writer may have resized some datasets of a table and not yet others:
                # the steps that are complete are those every per-step dataset holds.
                self.n_steps = min(f[f"{t}/{c}"].shape[0] for t, cols in _PER_STEP_TABLES.items() for c in cols)
            except (KeyError, OSError, ValueError, json.JSONDecodeError) as e:
                raise TraceFormatError(f"{path} is a torchautopsy trace with missing or damaged "
                                       f"parts ({e}); it cannot be analyzed") from None
        try:
            meta["config"] = json.loads(meta.get("config", "{}"))
        except (TypeError, json.JSONDecodeError):
            meta["config"] = {}
        self.meta = meta
        self.rank = int(meta.get("rank", 0))

    # -- raw reads ----------------------------------------------------------------------------
    def _read(self, name: str, rows: int | None = None) -> np.ndarray:
        try:
            with _open(self.path) as f:
                ds = f[name]
                arr = ds[: rows] if rows is not None else ds[()]
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None
        arr = np.asarray(arr)
        arr.flags.writeable = False
        return arr

    def _frame(self, data: np.ndarray, index: np.ndarray, columns: list[str]) -> pd.DataFrame:
        df = pd.DataFrame(data, index=pd.Index(index, name="step"), columns=columns, copy=False)
        return df

    def _read_rows(self, name: str, rows, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(row indices, the rows) of the first n rows of a dataset: all of them (rows=None), a
        slice, or chosen rows. Chosen rows are gathered a block at a time: memory is bounded by
        the rows asked for, never by the length of the table."""
        sel = _row_selection(slice(None) if rows is None else rows, n)
        try:
            with _open(self.path) as f:
                ds = f[name]
                if isinstance(sel, slice) and sel.step == 1:
                    idx = np.arange(sel.start, max(sel.start, sel.stop))
                    out = ds[sel.start:max(sel.start, sel.stop)]
                else:
                    idx = np.arange(sel.start, sel.stop, sel.step) if isinstance(sel, slice) else sel
                    out = _gather(ds, idx)
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None
        out = np.asarray(out)
        out.flags.writeable = False
        return idx, out

    def blocks(self, name: str, stop: int | None = None, start: int = 0):
        """Yield (first row, rows) of a dataset, one block of rows at a time, up to ``stop``
        (default: the steps every per-step table holds, for per-step tables)."""
        if stop is None:
            table = name.split("/", 1)[0]
            stop = self.n_steps if table in _PER_STEP_TABLES else None
        try:
            with _open(self.path) as f:
                ds = f[name]
                stop = ds.shape[0] if stop is None else min(stop, ds.shape[0])
                step = block_rows(_width(ds))
                for a in range(start, stop, step):
                    block = np.asarray(ds[a:min(a + step, stop)])
                    block.flags.writeable = False
                    yield a, block
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None

    def rows_in_span(self, lo: float, hi: float) -> slice:
        """The rows of the per-step tables whose step lies in [lo, hi]."""
        idx = self.step_index
        return slice(int(np.searchsorted(idx, lo, "left")), int(np.searchsorted(idx, hi, "right")))

    # -- views --------------------------------------------------------------------------------
    @property
    def closed_cleanly(self) -> bool:
        return bool(self.meta.get("closed", False))

    @cached_property
    def step_index(self) -> np.ndarray:
        return self._read("steps/step", self.n_steps)

    @cached_property
    def steps(self) -> "StepColumns":
        """One row per step: time_s, loss, rss_bytes, cuda_*_bytes, nonfinite_origin,
        batch_nonfinite, live_tensors*, and the step's time split (*_s). Indexed like a
        DataFrame (``rt.steps["loss"]`` is a Series by step), but each column is read from the
        file when asked for and not kept: a million steps hold 8 MB a column, not 130 MB."""
        return StepColumns(self)

    def _step_column(self, col: str) -> np.ndarray:
        missing = _OPTIONAL_STEP_COLUMNS.get(col)
        if missing is not None and not self._has(f"steps/{col}"):
            return np.full(self.n_steps, missing)  # added to schema 1 after its first traces
        data = self._read(f"steps/{col}", self.n_steps)
        if len(data) < self.n_steps:  # a kill can leave a later column a row short
            data = np.concatenate([data, np.full(self.n_steps - len(data), missing if missing is not None
                                                 else np.nan).astype(data.dtype)])
        return data

    def param_stat(self, stat: str, rows=None) -> pd.DataFrame:
        """Steps x parameters: grad_norm, grad_absmax, grad_nonfinite or param_norm; of every
        step, or of ``rows`` only (a slice or row indices, see ``rows_in_span``)."""
        if stat not in PARAM_STATS:
            raise ValueError(f"unknown parameter statistic {stat!r}; one of {PARAM_STATS}")
        idx, data = self._read_rows(f"params/{stat}", rows, self.n_steps)
        return self._frame(data, self.step_index[idx], self.param_names)

    def module_stat(self, stat: str = "output_absmax", rows=None) -> pd.DataFrame:
        """Steps x modules: max |output| per step (NaN/Inf when the output was; -1 = not called)."""
        if stat not in MODULE_STATS:
            raise ValueError(f"unknown module statistic {stat!r}; one of {MODULE_STATS}")
        idx, data = self._read_rows(f"modules/{stat}", rows, self.n_steps)
        return self._frame(data, self.step_index[idx], self.module_names)

    def activation_stat(self, stat: str, rows=None) -> pd.DataFrame:
        """Sampled steps x modules: mean, std, absmax, zero_frac or nonfinite of each output
        (``rows``: of the samples)."""
        if stat not in ACTIVATION_STATS:
            raise ValueError(f"unknown activation statistic {stat!r}; one of {ACTIVATION_STATS}")
        steps = self._sampled_steps("activations", ACTIVATION_STATS)
        idx, data = self._read_rows(f"activations/{stat}", rows, len(steps))
        return self._frame(data, steps[idx], self.module_names)

    def update_ratio(self, rows=None) -> pd.DataFrame:
        """Sampled steps x parameters: ||w_after - w_before|| / ||w_before|| of that step's update
        (``rows``: of the samples)."""
        steps = self._sampled_steps("updates", ("ratio",))
        idx, data = self._read_rows("updates/ratio", rows, len(steps))
        return self._frame(data, steps[idx], self.param_names)

    def sample_steps(self, table: str) -> np.ndarray:
        """The steps of a sampled table's rows (activations, updates); empty if absent."""
        cols = {"activations": ACTIVATION_STATS, "updates": ("ratio",)}.get(table, ())
        return self._sampled_steps(table, cols) if self._has(f"{table}/step") else np.zeros(0, np.int64)

    def n_samples(self, table: str) -> int:
        """Rows of a sampled table (activations, updates, attention); 0 if absent."""
        cols = {"activations": ACTIVATION_STATS, "updates": ("ratio",)}.get(table, ("step",))
        return len(self._sampled_steps(table, cols)) if self._has(f"{table}/step") else 0

    def _sampled_steps(self, table: str, cols) -> np.ndarray:
        try:
            with _open(self.path) as f:
                n = min(f[f"{table}/{c}"].shape[0] for c in ("step", *cols))
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {table} ({e})") from None
        return self._read(f"{table}/step", n)

    def _n_rows(self, table: str, cols) -> int:
        """Rows every column of a table holds (a kill can leave one a row longer); 0 if the
        table is absent (an older trace)."""
        try:
            with _open(self.path) as f:
                if table not in f:
                    return 0
                return min(f[f"{table}/{c}"].shape[0] for c in cols)
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {table} ({e})") from None

    def _has(self, name: str) -> bool:
        with _open(self.path) as f:
            return name in f

    def _table(self, table: str, cols: tuple[str, ...]) -> dict[str, np.ndarray]:
        """All columns of a table, cut to the rows every column holds (a kill can leave one
        column a row longer); an absent table (older trace) reads as empty."""
        if not self._has(table):
            return {c: np.zeros(0) for c in cols}
        n = self._n_rows(table, cols)
        return {c: self._read(f"{table}/{c}", n) for c in cols}

    def _texts_table(self, table: str, cols: tuple[str, ...], texts: tuple[str, ...]) -> pd.DataFrame:
        """A table as a DataFrame, its text columns decoded."""
        df = pd.DataFrame(self._table(table, cols))
        for c in texts:
            df[c] = _texts(df[c])
        return df

    def _sites(self, table: str, cols: tuple[str, ...], *texts: str) -> pd.DataFrame:
        """A site table with its text columns decoded and module indices turned into names
        (``module``), the index kept as ``module_index``."""
        df = self._texts_table(table, cols, texts)
        df["module_index"] = df["module"].astype(int)
        df["module"] = [self.module_names[i] if 0 <= i < len(self.module_names) else f"#{i}"
                        for i in df["module_index"]]
        return df

    @cached_property
    def activity_sites(self) -> pd.DataFrame:
        """Activation-function call sites: module (name), function, call, param, unit_dim,
        units, bit_offset, first_step. One row per site, in the order they were first seen."""
        cols = ("module", "function", "call", "param", "unit_dim", "units", "bit_offset", "first_step")
        return self._sites("activity_sites", cols, "function")

    def activity_windows(self):
        """Yield (step_start, step_end, steps_seen per site, ever_positive bits per unit,
        saturated_frac per site), one window at a time, oldest first."""
        cols = ("step_start", "step_end", "steps_seen", "ever_positive", "saturated_frac")
        n = self._n_rows("activity", cols)
        n_bits = int((self.activity_sites["bit_offset"] + self.activity_sites["units"]).max()) \
            if len(self.activity_sites) else 0
        # A block of windows at a time: a long run has tens of thousands of windows.
        for start in range(0, n, _WINDOWS_PER_READ):
            stop = min(n, start + _WINDOWS_PER_READ)
            t = {c: self._read_rows(f"activity/{c}", slice(start, stop), n)[1] for c in cols}
            for i in range(stop - start):
                bits = np.unpackbits(np.asarray(t["ever_positive"][i], dtype=np.uint8), bitorder="little")
                bits = np.concatenate([bits, np.zeros(max(0, n_bits - bits.size), dtype=np.uint8)])
                yield (int(t["step_start"][i]), int(t["step_end"][i]), t["steps_seen"][i],
                       bits[:n_bits].astype(bool), t["saturated_frac"][i])

    @cached_property
    def attention_sites(self) -> pd.DataFrame:
        """Attention call sites: module (name), source, call, heads, head_offset, first_step."""
        cols = ("module", "source", "call", "heads", "head_offset", "first_step")
        return self._sites("attention_sites", cols, "source")

    def attention_stat(self, stat: str) -> pd.DataFrame:
        """Sampled steps x heads ("module/h0", ...) for entropy, max_weight, sink_share; steps x
        sites (module names) for head_similarity and keys."""
        per_head = ("entropy", "max_weight", "sink_share")
        if stat not in per_head + ("head_similarity", "keys"):
            raise ValueError(f"unknown attention statistic {stat!r}")
        t = self._table("attention", ("step", stat))
        sites = self.attention_sites
        if stat in per_head:
            cols = [f"{m}/h{h}" for m, n in zip(sites["module"], sites["heads"]) for h in range(int(n))]
        else:
            cols = [f"{m}#{c}" if c else m for m, c in zip(sites["module"], sites["call"])]
        data = np.asarray(t[stat], dtype=np.float64)
        data = data.reshape(len(t["step"]), -1) if data.size else np.zeros((len(t["step"]), 0))
        width = len(cols)
        if data.shape[1] < width:  # rows written before later sites were seen
            data = np.pad(data, ((0, 0), (0, width - data.shape[1])), constant_values=np.nan)
        return self._frame(data[:, :width], t["step"], cols)

    @cached_property
    def census_groups(self) -> pd.DataFrame:
        """Live tensor census by group, one row per (census step, group): step, device, dtype,
        shape (str), graph (holds an autograd graph), count, bytes."""
        cols = ("step", "device", "dtype", "shape", "graph", "count", "bytes")
        return self._texts_table("census_groups", cols, ("device", "dtype", "shape"))

    @cached_property
    def module_outputs(self) -> pd.DataFrame:
        """The shape and dtype of each module's first floating-point output: module (name),
        module_index, shape (str), dtype."""
        return self._sites("module_outputs", ("module", "shape", "dtype"), "shape", "dtype")

    @cached_property
    def profile_windows(self) -> pd.DataFrame:
        """torch.profiler windows: window, step_start, step_end, trace_offset, trace_nbytes."""
        cols = ("window", "step_start", "step_end", "trace_offset", "trace_nbytes")
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
        """The Chrome trace (JSON bytes, as torch.profiler exported it) of one window."""
        w = self.profile_windows
        row = w[w["window"] == window]
        if row.empty:
            known = ", ".join(str(int(x)) for x in w["window"]) or "none"
            raise TraceFormatError(f"{self.path} has no profiler window {window} (windows: {known})")
        off, n = int(row["trace_offset"].iloc[0]), int(row["trace_nbytes"].iloc[0])
        try:
            with _open(self.path) as f:
                data = f["blobs/bytes"][off:off + n].tobytes()
            if len(data) != n:
                raise ValueError(f"{len(data)} of {n} bytes present")
            return gzip.decompress(data)
        except (KeyError, OSError, ValueError, EOFError) as e:
            raise TraceFormatError(f"{self.path}: profiler window {window} cannot be read ({e})") from None

    # -- CUDA allocator snapshots and out-of-memory events (optional tables) --------------------
    @cached_property
    def memory_snapshots(self) -> pd.DataFrame:
        """CUDA allocator snapshots: snapshot, step, reason (schedule, peak, oom, exception),
        time_s, device, allocated_bytes, reserved_bytes, n_device_traces, allocator_settings
        (JSON text), keys. Empty for CPU runs and older traces."""
        cols = ("snapshot", "step", "reason", "time_s", "device", "allocated_bytes", "reserved_bytes",
                "n_device_traces", "allocator_settings", "keys")
        return self._texts_table("memory_snapshots", cols, ("reason", "allocator_settings"))

    def memory_snapshot_rows(self, snapshot: int) -> dict[str, pd.DataFrame]:
        """One snapshot's rows: {"segments", "blocks", "trace"} DataFrames, in recorded order
        (columns as docs/trace_format.md lists them; ``stack`` indexes memory_stack)."""
        tables = {
            "segments": ("memory_segments", ("snapshot", "device", "address", "total_size", "allocated_size",
                                             "active_size", "requested_size", "stream", "segment_type", "pool_a",
                                             "pool_b", "is_expandable", "stack", "keys", "extra"), ("segment_type", "extra")),
            "blocks": ("memory_blocks", ("snapshot", "segment", "address", "size", "requested_size", "state",
                                         "stack", "keys", "extra"), ("state", "extra")),
            "trace": ("memory_trace", ("snapshot", "device", "action", "addr", "device_free", "size", "stream",
                                       "time_us", "compile_context", "user_metadata", "stack", "keys", "extra"),
                      ("action", "compile_context", "user_metadata", "extra")),
        }
        out = {}
        for key, (table, cols, texts) in tables.items():
            t = self._table(table, cols)
            sel = np.flatnonzero(np.asarray(t["snapshot"]) == snapshot)
            df = pd.DataFrame({c: np.asarray(t[c])[sel] for c in cols})
            for c in texts:
                df[c] = _texts(df[c])
            out[key] = df.reset_index(drop=True)
        return out

    @cached_property
    def _memory_stacks(self) -> tuple[list[dict], np.ndarray, np.ndarray, np.ndarray]:
        f = self._texts_table("memory_frames", ("filename", "line", "name", "keys", "extra"),
                              ("filename", "name", "extra"))
        frames = [{"filename": a, "line": int(b), "name": c, "keys": int(k), "extra": x}
                  for a, b, c, k, x in zip(f["filename"], f["line"], f["name"], f["keys"], f["extra"])]
        st = self._table("memory_stacks", ("first", "length"))
        sf = self._table("memory_stack_frames", ("frame",))
        return frames, np.asarray(st["first"], dtype=np.int64), np.asarray(st["length"], dtype=np.int64), \
            np.asarray(sf["frame"], dtype=np.int64)

    def memory_stack(self, stack: int) -> list[dict] | None:
        """The frames of a stack (dicts with filename, line, name, and ``keys``: which of those
        the snapshot had), innermost first as PyTorch records them; None for stack -1."""
        frames, first, length, sf = self._memory_stacks
        if stack < 0 or stack >= len(first):
            return None
        ids = sf[first[stack]:first[stack] + length[stack]]
        return [frames[i] for i in ids if 0 <= i < len(frames)]

    @cached_property
    def oom_events(self) -> pd.DataFrame:
        """Times memory ran out: step, time_s, source (observer: the CUDA allocator's; exception:
        an out-of-memory error left the Recorder's with-block), device, requested_bytes,
        device_allocated_bytes, device_reserved_bytes, device_free_bytes, device_total_bytes (-1:
        unknown), rss_bytes, snapshot, message, raised_at."""
        cols = ("step", "time_s", "source", "device", "requested_bytes", "device_allocated_bytes",
                "device_reserved_bytes", "device_free_bytes", "device_total_bytes", "rss_bytes", "snapshot",
                "message", "raised_at")
        return self._texts_table("oom_events", cols, ("source", "device", "message", "raised_at"))

    @cached_property
    def oom_tensor_groups(self) -> pd.DataFrame:
        """The tensor census taken when memory ran out: event, device, dtype, shape, graph, count, bytes."""
        cols = ("event", "device", "dtype", "shape", "graph", "count", "bytes")
        return self._texts_table("oom_tensor_groups", cols, ("device", "dtype", "shape"))

    @cached_property
    def digest(self) -> StepDigest:
        """Per-step series over all parameters, from one streaming pass (see StepDigest)."""
        d = StepDigest(self.n_steps)
        if not self.param_names:
            return d
        bad_blocks = self.blocks("params/grad_nonfinite")
        w_blocks = self.blocks("params/param_norm")
        for (a, g), (_, bad), (_, w) in zip(self.blocks("params/grad_norm"), bad_blocks, w_blocks):
            g = g.astype(np.float64)
            counted = bad > 0
            present = ~np.isnan(g) | counted
            sq = np.where(present, g * g, 0.0)
            with np.errstate(invalid="ignore", over="ignore"):
                tot = np.sqrt(sq.sum(axis=1))
            b = slice(a, a + len(g))
            d.grad_absent[b] = ~present.any(axis=1)
            tot[d.grad_absent[b]] = np.nan
            d.total_grad_norm[b] = tot
            d.grad_nonfinite[b] = counted.any(axis=1)
            d.param_nonfinite[b] = ~np.isfinite(w).all(axis=1)
        for arr in vars(d).values():
            arr.flags.writeable = False
        return d

    # -- stored tensors: snapshots, samples, the black box (docs/trace_format.md) --------------
    @cached_property
    def stored_tensors(self) -> pd.DataFrame:
        """One row per stored tensor: source (snapshot | sample | blackbox), step, name, role,
        dtype, shape (tuple), location (blobs | snapshots), offset, nbytes. Snapshot rows whose
        slot was reused since are still listed; ``snapshots`` says which are kept."""
        cols = ("source", "step", "name", "role", "dtype", "shape", "location", "offset", "nbytes")
        df = self._texts_table("tensors", cols, ("source", "name", "role", "dtype", "shape", "location"))
        shapes = []
        for text in df["shape"]:
            try:
                shape = tuple(int(v) for v in json.loads(text))
            except (TypeError, ValueError, json.JSONDecodeError):
                raise TraceFormatError(f"{self.path}: a stored tensor has a bad shape {text[:40]!r}") from None
            shapes.append(shape)
        df["shape"] = shapes
        return df

    @cached_property
    def snapshots(self) -> pd.DataFrame:
        """The parameter snapshots the trace still holds, oldest first: step, slot, offset,
        nbytes, crc32, dtype ("exact" or the half precision floats were stored in). A slot holds
        the snapshot of its latest row (older ones were overwritten to keep the disk budget)."""
        cols = ("step", "slot", "offset", "nbytes", "crc32", "dtype")
        df = self._texts_table("snapshots", cols, ("dtype",))
        if not len(df):
            return df
        df = df.drop_duplicates("slot", keep="last")
        t = self.stored_tensors
        have = set(t.loc[(t["source"] == "snapshot"), "step"].astype(int))
        df = df[df["step"].astype(int).isin(have)]
        return df.sort_values("step").reset_index(drop=True)

    @cached_property
    def blackbox(self) -> pd.DataFrame:
        """The black box, if it fired: step, trigger, params_at (start_of_step: before the bad
        update; end_of_step: after it; at_exit), detail (dict)."""
        df = self._texts_table("blackbox", ("step", "trigger", "params_at", "detail"),
                               ("trigger", "params_at", "detail"))
        details = []
        for text in df["detail"]:
            try:
                d = json.loads(text)
            except (TypeError, json.JSONDecodeError):
                d = {}
            details.append(d if isinstance(d, dict) else {})
        df["detail"] = details
        return df

    def tensors_of(self, source: str, step: int) -> pd.DataFrame:
        """The stored tensors of one snapshot, sample step or black box (rows of stored_tensors)."""
        t = self.stored_tensors
        rows = t[(t["source"] == source) & (t["step"] == step)]
        if source == "snapshot":
            snap = self.snapshots[self.snapshots["step"] == step]
            if snap.empty:
                return rows.iloc[0:0]
            lo, n = int(snap["offset"].iloc[-1]), int(snap["nbytes"].iloc[-1])
            rows = rows[(rows["location"] == "snapshots") & (rows["offset"] >= lo) & (rows["offset"] + rows["nbytes"] <= lo + n)]
            rows = rows.drop_duplicates("name", keep="last")
        return rows.reset_index(drop=True)

    def read_tensor_bytes(self, rows: pd.DataFrame, verify_snapshot: int | None = None) -> list[bytes]:
        """The raw bytes of stored tensors (rows of stored_tensors), in order; with
        ``verify_snapshot`` (a step), first check that snapshot's slot against its crc32."""
        out = []
        try:
            with _open(self.path) as f:
                if verify_snapshot is not None:
                    snap = self.snapshots[self.snapshots["step"] == verify_snapshot].iloc[-1]
                    lo, n = int(snap["offset"]), int(snap["nbytes"])
                    slot = f["snapshots/bytes"][lo:lo + n].tobytes()
                    if len(slot) != n or (zlib.crc32(slot) & 0xFFFFFFFF) != (int(snap["crc32"]) & 0xFFFFFFFF):
                        raise TraceFormatError(
                            f"{self.path}: the snapshot of step {verify_snapshot} is incomplete (the job was "
                            "killed while its slot was being rewritten)")
                for loc, off, n in zip(rows["location"], rows["offset"], rows["nbytes"]):
                    ds = f["snapshots/bytes" if loc == "snapshots" else "blobs/bytes"]
                    data = ds[int(off):int(off) + int(n)].tobytes()
                    if len(data) != int(n):
                        raise TraceFormatError(f"{self.path}: a stored tensor is cut short "
                                               f"({len(data)} of {int(n)} bytes present)")
                    out.append(data)
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: stored tensors cannot be read ({e})") from None
        return out

    @cached_property
    def histogram_bins(self) -> tuple[np.ndarray, np.ndarray]:
        """(lower, upper) edges of the histogram bins (NaN bin: NaN, NaN; -Inf and +Inf bins:
        -inf and +inf); empty arrays in traces without histograms."""
        if not self._has("histogram_bins/lower"):
            return np.zeros(0), np.zeros(0)
        return self._read("histogram_bins/lower"), self._read("histogram_bins/upper")

    def histograms(self, kind: str, rows=None) -> tuple[np.ndarray, list[str], np.ndarray]:
        """(steps, names, counts[steps, names, bins]) of the sampled histograms of kind weight,
        grad (names: parameters) or activation (names: modules). Counts of -1: not recorded
        (no gradient, module not called). ``rows``: the row numbers to read (sorted), to bound
        memory on a long run (all rows by default). Empty in traces without histograms."""
        if kind not in HIST_KINDS:
            raise ValueError(f"unknown histogram kind {kind!r}; one of {HIST_KINDS}")
        lower, _ = self.histogram_bins
        if not lower.size:
            return np.zeros(0, np.int64), [], np.zeros((0, 0, 0), np.int32)
        table, index = (("histogram_modules/module", self.module_names) if kind == "activation"
                        else ("histogram_params/param", self.param_names))
        idx = self._read(table)
        names = [index[i] if 0 <= i < len(index) else f"#{i}" for i in idx]
        steps = self.histogram_steps
        rows = np.arange(len(steps)) if rows is None else np.unique(np.asarray(rows, dtype=np.int64))
        rows = rows[(rows >= 0) & (rows < len(steps))]
        try:
            with _open(self.path) as f:
                data = f[f"histograms/{kind}"][rows.tolist()] if rows.size else np.zeros((0, len(names) * lower.size))
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read histograms/{kind} ({e})") from None
        counts = np.asarray(data).reshape(len(rows), len(names), lower.size)
        return steps[rows], names, counts

    @cached_property
    def histogram_steps(self) -> np.ndarray:
        """The steps of the histogram rows every histogram dataset holds (empty without them)."""
        if not self._has("histograms/step"):
            return np.zeros(0, np.int64)
        return np.asarray(self._sampled_steps("histograms", HIST_KINDS), dtype=np.int64)

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
        ``positive_max`` (the
        largest finite value > 0, NaN where none: for log scales).
        """
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
            with np.errstate(invalid="ignore"):
                hi = np.fmax.reduceat(np.where(finite, v, np.nan), starts, axis=0)
                lo = np.fmin.reduceat(np.where(finite, v, np.nan), starts, axis=0)
                pos = np.fmax.reduceat(np.where(finite & (v > 0), v, np.nan), starts, axis=0)
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
        t = self.steps["time_s"].to_numpy()
        if t.size == 0:
            return 0.0
        return float(t[-1] - self.meta.get("start_unix", t[0]))


def _gather(ds, idx: np.ndarray) -> np.ndarray:
    """Rows idx (sorted, unique) of a dataset, read a block at a time: a handful of reads for
    rows close together, never more memory than the rows asked for plus one block."""
    out = np.empty((len(idx),) + ds.shape[1:], dtype=ds.dtype)
    span = block_rows(_width(ds))
    k = 0
    while k < len(idx):
        a = int(idx[k])
        stop = int(np.searchsorted(idx, a + span))
        out[k:stop] = ds[a:int(idx[stop - 1]) + 1][idx[k:stop] - a]
        k = stop
    return out


def _width(ds) -> int:
    return int(np.prod(ds.shape[1:])) if len(ds.shape) > 1 else 1


# Step columns added to schema 1 after its first traces, and what they read as when absent.
_OPTIONAL_STEP_COLUMNS = {
    **dict.fromkeys(("live_tensors", "live_tensor_bytes", "live_tensors_with_graph"), -1),
    **dict.fromkeys(("between_steps_s", "data_wait_s", "forward_s", "backward_s", "recorder_s"), np.nan),
    "gc_s": np.nan,  # time in garbage collection during the step
    "gc_gen2": -1,  # full (generation 2) collections during the step
}
STEP_COLUMNS = ("time_s", "loss", "rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes",
                "cuda_peak_bytes", "nonfinite_origin", "batch_nonfinite", *_OPTIONAL_STEP_COLUMNS)


class StepColumns:
    """The per-step table of a rank, read a column at a time (see RankTrace.steps)."""

    columns = STEP_COLUMNS

    def __init__(self, rt: RankTrace):
        self._rt = rt
        self.index = pd.Index(rt.step_index, name="step")

    def __getitem__(self, col):
        """A column as a Series by step; a list of columns as a DataFrame."""
        if isinstance(col, (list, tuple)):
            return self.frame(col)
        if col not in self.columns:
            raise KeyError(col)
        return pd.Series(self._rt._step_column(col), index=self.index, name=col, copy=False)

    def __contains__(self, col) -> bool:
        return col in self.columns

    def __len__(self) -> int:
        return len(self.index)

    def frame(self, cols=STEP_COLUMNS) -> pd.DataFrame:
        """Those columns as a DataFrame (all of them: 130 bytes a step)."""
        return pd.DataFrame({c: self[c] for c in cols}, index=self.index)


class Trace:
    """A run directory: every rank's trace, keyed by rank."""

    def __init__(self, run_dir: str, ranks: dict[int, RankTrace], unreadable: dict[str, str]):
        self.run_dir = run_dir
        self.ranks = dict(sorted(ranks.items()))
        self.unreadable = unreadable  # file -> reason, for ranks that could not be read

    @property
    def size_bytes(self) -> int:
        return sum(r.size_bytes for r in self.ranks.values())

    def __repr__(self) -> str:
        return f"Trace({self.run_dir!r}, ranks={list(self.ranks)})"


def trace_files(path: str) -> list[str]:
    """The rank files of a run directory (or the one file given)."""
    if not os.path.exists(path):
        raise TraceNotFoundError(f"{path} does not exist; give the run directory passed to "
                                 "Recorder(model, run_dir)")
    if os.path.isfile(path):
        return [path]
    files = [os.path.join(path, n) for n in os.listdir(path) if _RANK_FILE.match(n)]
    if not files:
        raise TraceNotFoundError(f"{path} holds no rank*.h5 trace files; give the run directory "
                                 "passed to Recorder(model, run_dir)")
    return sorted(files, key=lambda p: int(_RANK_FILE.match(os.path.basename(p)).group(1)))


def load(run_dir) -> Trace:
    """Open a run directory (or one rank file) for reading.

    Raises a TraceError subclass with a one-line reason if nothing in it can be analyzed; a
    multi-rank run with some unreadable files loads the readable ones and lists the others in
    ``Trace.unreadable``.
    """
    run_dir = os.fspath(run_dir)
    ranks: dict[int, RankTrace] = {}
    unreadable: dict[str, str] = {}
    files = trace_files(run_dir)
    first_error = None
    for p in files:
        try:
            rt = RankTrace(p)
        except (TraceFormatError, SchemaVersionError) as e:
            first_error = first_error or e
            unreadable[p] = str(e)
            continue
        ranks[rt.rank] = rt
    if not ranks:
        raise first_error
    return Trace(run_dir, ranks, unreadable)
