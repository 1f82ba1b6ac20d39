"""One rank's trace (``rank{N}.h5``), read lazily: the per-step tables, the sampled ones, the
windows and sites, and the per-step digest."""

from __future__ import annotations

import os
from functools import cached_property

import numpy as np
import pandas as pd

from ..errors import SchemaVersionError, TraceFormatError
from . import schema
from .format import (ACTIVATION_STATS, FORMAT_NAME, MODULE_STATS, PARAM_STATS, SCHEMA_VERSION,
                     UNMEASURED_IS_NEGATIVE,
                     _PER_STEP_TABLES, _attr, _open, _strings, _texts, parse_json, rank_of_file)
from .memory_tables import MemoryTables
from .stored_tensors import StoredTensors
from .streaming import _WINDOWS_PER_READ, StepDigest, _gather, _row_selection, _width, block_rows


def _shape(text: str) -> tuple[int, ...]:
    shape = parse_json(text)
    if not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 2**53 for d in shape):
        raise ValueError(f"a parameter shape reads {text[:40]!r}")
    return tuple(shape)


class RankTrace(MemoryTables, StoredTensors):
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
                # of this rank's shard (analyzer/trace/shards.py combines them). 1 in older traces.
                shards = f["params/shards"][()] if "params/shards" in f else np.ones(len(self.param_names))
                shards = np.asarray(schema.numeric(path, "params/shards", shards), dtype=np.int64)
                if shards.shape != (len(self.param_names),) or (shards < 1).any():
                    raise ValueError("params/shards is not one count >= 1 per parameter")
                self.param_shards = shards
                self.module_names = _strings(f["modules/name"])
                self.module_types = _strings(f["modules/type"])
                self.module_is_leaf = np.asarray(f["modules/is_leaf"][()], dtype=bool)
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

    # -- raw reads ----------------------------------------------------------------------------
    def _read(self, name: str, rows: int | None = None, text: bool = False, ndim: int | None = None) -> np.ndarray:
        """A dataset (its first ``rows`` rows), read-only; numbers unless ``text``, of ``ndim``
        dimensions if given."""
        try:
            with _open(self.path) as f:
                ds = f[name]
                arr = ds[: rows] if rows is not None else ds[()]
        except (KeyError, OSError, ValueError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None
        arr = np.asarray(arr)
        if not text:
            schema.numeric(self.path, name, arr)
        if ndim is not None and arr.ndim != ndim:
            raise TraceFormatError(f"{self.path}: {name} has shape {arr.shape}, not {ndim}-D; the trace is damaged")
        arr.flags.writeable = False
        return arr

    def _frame(self, data: np.ndarray, index: np.ndarray, columns: list[str], name: str) -> pd.DataFrame:
        if data.ndim != 2 or data.shape[1] != len(columns):
            raise TraceFormatError(f"{self.path}: {name} is {data.shape[1:]} wide, not one column per name "
                                   f"({len(columns):,}); the trace is damaged")
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
        out = schema.numeric(self.path, name, np.asarray(out))
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
                if ds.dtype.kind not in "iufb" or ds.ndim not in (1, 2):
                    raise TraceFormatError(f"{self.path}: {name} holds {ds.dtype} {ds.shape}, not a "
                                           "table of numbers; the trace is damaged")
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
        return self._frame(data, self.step_index[idx], self.param_names, f"params/{stat}")

    def module_stat(self, stat: str = "output_absmax", rows=None) -> pd.DataFrame:
        """Steps x modules: max |output| per step (NaN/Inf when the output was; -1 = not called)."""
        if stat not in MODULE_STATS:
            raise ValueError(f"unknown module statistic {stat!r}; one of {MODULE_STATS}")
        idx, data = self._read_rows(f"modules/{stat}", rows, self.n_steps)
        return self._frame(data, self.step_index[idx], self.module_names, f"modules/{stat}")

    def activation_stat(self, stat: str, rows=None) -> pd.DataFrame:
        """Sampled steps x modules: mean, std, absmax, zero_frac or nonfinite of each output
        (``rows``: of the samples)."""
        if stat not in ACTIVATION_STATS:
            raise ValueError(f"unknown activation statistic {stat!r}; one of {ACTIVATION_STATS}")
        steps = self._sampled_steps("activations", ACTIVATION_STATS)
        idx, data = self._read_rows(f"activations/{stat}", rows, len(steps))
        return self._frame(data, steps[idx], self.module_names, f"activations/{stat}")

    def update_ratio(self, rows=None) -> pd.DataFrame:
        """Sampled steps x parameters: ||w_after - w_before|| / ||w_before|| of that step's update
        (``rows``: of the samples)."""
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

    def _sampled_steps(self, table: str, cols) -> np.ndarray:
        try:
            with _open(self.path) as f:
                n = min(f[f"{table}/{c}"].shape[0] for c in ("step", *cols))
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {table} ({e})") from None
        return self._read(f"{table}/step", n, ndim=1)

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

    def lacks(self, name: str) -> bool:
        """Whether the trace lacks dataset ``name`` (e.g. "steps/lr") and the reader cannot fill it
        in: step columns added after the first traces read as "not measured" when absent."""
        return name.removeprefix("steps/") not in _OPTIONAL_STEP_COLUMNS and not self._has(name)

    def _has(self, name: str) -> bool:
        with _open(self.path) as f:
            return name in f

    def _table(self, table: str, cols: tuple[str, ...], texts: tuple[str, ...] = (),
               ndim: int | None = None) -> dict[str, np.ndarray]:
        """All columns of a table, cut to the rows every column holds (a kill can leave one
        column a row longer); an absent table (older trace) reads as empty. Columns not in
        ``texts`` must hold numbers; all of ``ndim`` dimensions if given."""
        if not self._has(table):
            return {c: np.zeros(0) for c in cols}
        n = self._n_rows(table, cols)
        return {c: self._read(f"{table}/{c}", n, text=c in texts, ndim=ndim) for c in cols}

    def _texts_table(self, table: str, cols: tuple[str, ...], texts: tuple[str, ...]) -> pd.DataFrame:
        """A table as a DataFrame, its text columns decoded."""
        df = pd.DataFrame(self._table(table, cols, texts, ndim=1))
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
        saturated_frac per site, steps watched), one window at a time, oldest first. A site
        is seen only on watched steps (schema 2: every activations_every-th step; before it,
        every step of the window)."""
        cols = ("step_start", "step_end", "steps_seen", "ever_positive", "saturated_frac")
        watched_col = self._has("activity/steps_watched")
        n = self._n_rows("activity", cols + (("steps_watched",) if watched_col else ()))
        n_bits = self._site_extent(self.activity_sites, "bit_offset", "units", "activity/ever_positive", 8)
        # A block of windows at a time: a long run has tens of thousands of windows.
        for start in range(0, n, _WINDOWS_PER_READ):
            stop = min(n, start + _WINDOWS_PER_READ)
            t = {c: self._read_rows(f"activity/{c}", slice(start, stop), n)[1] for c in cols}
            watched = self._read_rows("activity/steps_watched", slice(start, stop), n)[1] if watched_col else \
                t["step_end"] - t["step_start"] + 1
            for i in range(stop - start):
                bits = np.unpackbits(np.asarray(t["ever_positive"][i], dtype=np.uint8), bitorder="little")
                bits = np.concatenate([bits, np.zeros(max(0, n_bits - bits.size), dtype=np.uint8)])
                yield (int(t["step_start"][i]), int(t["step_end"][i]), t["steps_seen"][i],
                       bits[:n_bits].astype(bool), t["saturated_frac"][i], int(watched[i]))

    # Sites seen after a table's last row are not in it yet (a kill): their columns may lie past
    # its width by this much, no more.
    _SITE_MARGIN = 1 << 16

    def _site_extent(self, sites: pd.DataFrame, offset: str, count: str, table: str, per_column: int) -> int:
        """The columns (or bits) the sites of a table span, checked against the table's width so
        that a damaged offset or count cannot make a reader allocate what it says."""
        if not len(sites):
            return 0
        off = np.asarray(sites[offset], dtype=np.int64)
        cnt = np.asarray(sites[count], dtype=np.int64)
        extent = int((off + cnt).max()) if off.min() >= 0 and cnt.min() >= 0 else -1
        width = self._width_of(table) * per_column
        if extent < 0 or extent > width + self._SITE_MARGIN:
            raise TraceFormatError(f"{self.path}: the {table.split('/')[0]} sites' {offset} and {count} do not fit "
                                   f"{table} ({width:,} wide); the trace is damaged")
        return extent

    def _width_of(self, name: str) -> int:
        try:
            with _open(self.path) as f:
                return int(f[name].shape[1]) if name in f and f[name].ndim == 2 else 0
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {name} ({e})") from None

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
            self._site_extent(sites, "head_offset", "heads", f"attention/{stat}", 1)
            cols = [f"{m}/h{h}" for m, n in zip(sites["module"], sites["heads"]) for h in range(int(n))]
        else:
            cols = [f"{m}#{c}" if c else m for m, c in zip(sites["module"], sites["call"])]
        data = np.asarray(t[stat], dtype=np.float64)
        data = data.reshape(len(t["step"]), -1) if data.size else np.zeros((len(t["step"]), 0))
        width = len(cols)
        if data.shape[1] < width:  # rows written before later sites were seen
            data = np.pad(data, ((0, 0), (0, width - data.shape[1])), constant_values=np.nan)
        return self._frame(data[:, :width], t["step"], cols, f"attention/{stat}")

    @cached_property
    def census_groups(self) -> pd.DataFrame:
        """Live tensor census by group, one row per (census step, group): step, device, dtype,
        shape (str), graph (holds an autograd graph), grad_fn (the graph's last op, e.g.
        ReluBackward0; "" without a graph or in older traces), count, bytes."""
        texts = ("device", "dtype", "shape") + (("grad_fn",) if self._has("census_groups/grad_fn") else ())
        cols = ("step", "device", "dtype", "shape", "graph", "count", "bytes")
        df = self._texts_table("census_groups", cols + texts[3:], texts)
        if "grad_fn" not in df:
            df["grad_fn"] = ""
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
    def module_outputs(self) -> pd.DataFrame:
        """The shape and dtype of each module's first floating-point output: module (name),
        module_index, shape (str), dtype, grad_fn (the op that made it; "" if none or unknown)."""
        extra = ("grad_fn",) if self._has("module_outputs/grad_fn") else ()
        df = self._sites("module_outputs", ("module", "shape", "dtype") + extra, "shape", "dtype", *extra)
        if "grad_fn" not in df:
            df["grad_fn"] = ""
        return df

    @cached_property
    def profile_windows(self) -> pd.DataFrame:
        """torch.profiler windows: window, step_start, step_end, trace_offset, trace_nbytes, and
        exported_unix (when the writer had exported it; absent from older traces)."""
        cols = ("window", "step_start", "step_end", "trace_offset", "trace_nbytes")
        if self._has("profile_windows/exported_unix"):
            cols += ("exported_unix",)
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
        t = self.steps["time_s"].to_numpy()
        if t.size == 0:
            return 0.0
        return float(t[-1] - self.meta.get("start_unix", t[0]))


# Step columns added to schema 1 after its first traces, and what they read as when absent.
_OPTIONAL_STEP_COLUMNS = {
    **dict.fromkeys(("live_tensors", "live_tensor_bytes", "live_tensors_with_graph"), -1),
    **dict.fromkeys(("between_steps_s", "data_wait_s", "forward_s", "backward_s", "recorder_s"), np.nan),
    "gc_s": np.nan,  # time in garbage collection during the step
    "gc_gen2": -1,  # full (generation 2) collections during the step
    # The optimizer's schedule (added to schema 2 later): NaN / -1 where not recorded.
    "lr": np.nan,
    "loss_scale": np.nan,
    "optimizer_steps": -1,
    "nonfinite_consumer": -1,  # (added later: the module that made a -Inf a fault)
    "loss_given": -1,  # (added later: 1 if rec.step() was given a loss; -1: not said)
    "output_grad_nonfinite": -1,  # (added later: the gradient at the model's outputs held NaN/Inf)
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
