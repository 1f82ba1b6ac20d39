"""Read a run directory of torchautopsy traces (one ``rank{N}.h5`` per rank).

This is the only place that knows the file layout (docs/trace_format.md) and its versions.
It never imports torch, never unpickles, and never executes anything from a trace.

    run = load("runs/exp1")
    rt = run.ranks[0]
    rt.steps                      # DataFrame, one row per step: loss, time, memory, ...
    rt.param_stat("grad_norm")    # DataFrame, steps x parameter names
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

    # -- views --------------------------------------------------------------------------------
    @property
    def closed_cleanly(self) -> bool:
        return bool(self.meta.get("closed", False))

    @cached_property
    def step_index(self) -> np.ndarray:
        return self._read("steps/step", self.n_steps)

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per step: time_s, loss, rss_bytes, cuda_*_bytes, nonfinite_origin, batch_nonfinite."""
        cols = ("time_s", "loss", "rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes",
                "cuda_peak_bytes", "nonfinite_origin", "batch_nonfinite")
        data = {c: self._read(f"steps/{c}", self.n_steps) for c in cols}
        # Columns added to schema 1 after its first traces: absent ones read as "not measured".
        for group, missing in ((("live_tensors", "live_tensor_bytes", "live_tensors_with_graph"), -1),
                               (("between_steps_s", "data_wait_s", "forward_s", "backward_s", "recorder_s"), np.nan)):
            have = self._has(f"steps/{group[0]}")
            table = self._table("steps", group) if have else {}
            for c in group:
                data[c] = table[c][: self.n_steps] if have else np.full(self.n_steps, missing)
        return pd.DataFrame(data, index=pd.Index(self.step_index, name="step"))

    def param_stat(self, stat: str) -> pd.DataFrame:
        """Steps x parameters: grad_norm, grad_absmax, grad_nonfinite or param_norm."""
        if stat not in PARAM_STATS:
            raise ValueError(f"unknown parameter statistic {stat!r}; one of {PARAM_STATS}")
        return self._frame(self._read(f"params/{stat}", self.n_steps), self.step_index, self.param_names)

    def module_stat(self, stat: str = "output_absmax") -> pd.DataFrame:
        """Steps x modules: max |output| per step (NaN/Inf when the output was; -1 = not called)."""
        if stat not in MODULE_STATS:
            raise ValueError(f"unknown module statistic {stat!r}; one of {MODULE_STATS}")
        return self._frame(self._read(f"modules/{stat}", self.n_steps), self.step_index, self.module_names)

    def activation_stat(self, stat: str) -> pd.DataFrame:
        """Sampled steps x modules: mean, std, absmax, zero_frac or nonfinite of each output."""
        if stat not in ACTIVATION_STATS:
            raise ValueError(f"unknown activation statistic {stat!r}; one of {ACTIVATION_STATS}")
        steps = self._sampled_steps("activations", ACTIVATION_STATS)
        return self._frame(self._read(f"activations/{stat}", len(steps)), steps, self.module_names)

    def update_ratio(self) -> pd.DataFrame:
        """Sampled steps x parameters: ||w_after - w_before|| / ||w_before|| of that step's update."""
        steps = self._sampled_steps("updates", ("ratio",))
        return self._frame(self._read("updates/ratio", len(steps)), steps, self.param_names)

    def _sampled_steps(self, table: str, cols) -> np.ndarray:
        try:
            with _open(self.path) as f:
                n = min(f[f"{table}/{c}"].shape[0] for c in ("step", *cols))
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {table} ({e})") from None
        return self._read(f"{table}/step", n)

    def _has(self, name: str) -> bool:
        with _open(self.path) as f:
            return name in f

    def _table(self, table: str, cols: tuple[str, ...]) -> dict[str, np.ndarray]:
        """All columns of a table, cut to the rows every column holds (a kill can leave one
        column a row longer); an absent table (older trace) reads as empty."""
        try:
            with _open(self.path) as f:
                if table not in f:
                    return {c: np.zeros(0) for c in cols}
                n = min(f[f"{table}/{c}"].shape[0] for c in cols)
        except (KeyError, OSError) as e:
            raise TraceFormatError(f"{self.path}: cannot read {table} ({e})") from None
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
        t = self._table("activity", cols)
        n_bits = int((self.activity_sites["bit_offset"] + self.activity_sites["units"]).max()) \
            if len(self.activity_sites) else 0
        for i in range(len(t["step_start"])):
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
        g = self.param_stat("grad_norm").to_numpy(dtype=np.float64)
        present = ~np.isnan(g) | (self.param_stat("grad_nonfinite").to_numpy() > 0)
        sq = np.where(present, g * g, 0.0)
        with np.errstate(invalid="ignore"):
            tot = np.sqrt(sq.sum(axis=1))
        tot[~present.any(axis=1)] = np.nan
        return pd.Series(tot, index=pd.Index(self.step_index, name="step"), name="total_grad_norm")

    @property
    def wall_time_s(self) -> float:
        t = self.steps["time_s"].to_numpy()
        if t.size == 0:
            return 0.0
        return float(t[-1] - self.meta.get("start_unix", t[0]))


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
