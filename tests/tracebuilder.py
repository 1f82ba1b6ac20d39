"""Small synthetic traces in the real format (docs/trace_format.md), written without torch.

A test states only what it is about; every other column holds what the recorder writes for
"not measured" (-1, NaN, no gradient), so a trace the builder writes reads exactly as a
recorded one (tests/analyzer/test_tracebuilder_format.py compares the two):

    b = TraceBuilder.mlp(layers=3, steps=100)       # Sequential of Linear/ReLU, 100 steps
    b.loss(np.linspace(2.0, 1.0, 100)).total_grad_norm(1.0)
    b.set("params/grad_norm", 1e4, at=slice(60, None), col="4.weight")
    b.set("steps/nonfinite_origin", 2, at=37)       # a module index, as the recorder writes it
    b.activations(range(0, 100, 10), absmax={"4": 1.0})
    b.fingerprints([0, 50], {"0.weight": [7, 8]})    # replicas' parameter checksums (int64)
    b.heartbeats([{"time_unix": 1.7e9 + 60, "step": 100, "phase": "backward", "step_s": 50.0}])  # a stall
    b.write(tmp_path)                               # tmp_path/rank0.h5
    findings(tmp_path, "exploding_gradients")       # the real analyzer's findings of one kind

``at`` is a step number, a list of them or a slice of step numbers (slice(60, None): steps 60
and later); ``col`` a parameter or module name, or a list of them. This module never imports
torch, nor anything of torchautopsy.recorder (which does): the layout below is checked against
what the recorder writes instead.
"""

from __future__ import annotations

import datetime as _dt
import json
import os

import h5py
import numpy as np

from torchautopsy import trace_schema
from torchautopsy.trace_schema import FORMAT_NAME, SCHEMA_VERSION

_STR = h5py.string_dtype("utf-8")
P, M, G = trace_schema.PER_PARAM, trace_schema.PER_MODULE, "grows"  # widths of 2-D columns: per parameter, per module, growing
# The tables the builder writes: (column, numpy dtype or "str", width), as the recorder lays them out.
LAYOUT: dict[str, list[tuple]] = {
    # The per-step tables, from the one schema the recorder writes by (torchautopsy/trace_schema.py).
    **{t: [(c.name, c.dtype) + ((c.width,) if c.width != trace_schema.ONE else ()) for c in trace_schema.columns(t)]
       for t in trace_schema.PER_STEP_TABLES},
    "activations": [("step", "i8"), ("mean", "f4", M), ("std", "f4", M), ("absmax", "f4", M),
                    ("zero_frac", "f4", M), ("nonfinite", "i4", M)],
    "updates": [("step", "i8"), ("ratio", "f4", P)],
    "activity_sites": [("module", "i4"), ("function", "str"), ("call", "i4"), ("param", "f8"),
                       ("unit_dim", "i4"), ("units", "i8"), ("bit_offset", "i8"), ("first_step", "i8")],
    "activity": [("step_start", "i8"), ("step_end", "i8"), ("steps_seen", "i4", G), ("steps_watched", "i4"),
                 ("ever_positive", "u1", G), ("saturated_frac", "f4", G)],
    "attention_sites": [("module", "i4"), ("source", "str"), ("call", "i4"), ("heads", "i4"),
                        ("head_offset", "i8"), ("first_step", "i8")],
    "attention": [("step", "i8"), ("entropy", "f4", G), ("max_weight", "f4", G), ("sink_share", "f4", G),
                  ("head_similarity", "f4", G), ("keys", "i4", G)],
    "census_groups": [("step", "i8"), ("device", "str"), ("dtype", "str"), ("shape", "str"), ("graph", "i1"),
                      ("count", "i8"), ("bytes", "i8"), ("grad_fn", "str")],
    "module_outputs": [("module", "i4"), ("shape", "str"), ("dtype", "str"), ("grad_fn", "str")],
    "loss_checks": [("step", "i8"), ("outputs_nonfinite", "i1"), ("ops", "str")],
    "hyperparams": [("step", "i8"), ("optimizer", "i4"), ("group", "i4"), ("name", "str"), ("value", "f8")],
    "optimizers": [("optimizer", "i4"), ("class", "str"), ("first_step", "i8")],
    # Written only while steps stop coming (the recorder's heartbeat thread): a stall or a hang.
    "heartbeats": [("time_unix", "f8"), ("step", "i8"), ("phase", "str"), ("phase_s", "f4"), ("step_s", "f4"),
                   ("typical_step_s", "f4"), ("stack", "str")],
    # Every fingerprint_every steps: per parameter, an exact int64 checksum of its bits.
    "fingerprints": [("step", "i8"), ("bits", "i8", P)],
    # Empty unless the profiler ran / memory ran out; the recorder creates them in every trace.
    "profile_ops": [("window", "i4"), ("name", "str"), ("calls", "i8"), ("cpu_self_us", "f8"), ("cpu_total_us", "f8"),
                    ("device_self_us", "f8"), ("device_total_us", "f8"), ("cpu_memory_bytes", "i8"),
                    ("device_memory_bytes", "i8")],
    "oom_events": [("step", "i8"), ("time_s", "f8"), ("source", "str"), ("device", "str"), ("requested_bytes", "i8"),
                   ("device_allocated_bytes", "i8"), ("device_reserved_bytes", "i8"), ("device_free_bytes", "i8"),
                   ("device_total_bytes", "i8"), ("rss_bytes", "i8"), ("snapshot", "i4"), ("message", "str"),
                   ("raised_at", "str")],
}
HEARTBEAT_PHASES = ("data", "forward", "backward", "recorder", "between_steps")
PER_STEP = trace_schema.PER_STEP_TABLES
# What a per-step column holds where a test sets nothing: "not measured", or "nothing happened"
# (0 NaN/Inf elements, no loss given). None: written by the builder itself (step, time_s).
_FILL = {c.path: c.fill for c in trace_schema.PER_STEP}
# The recorder's options the analyzer reads (its defaults); config={} reads as an older recorder.
DEFAULT_CONFIG = {"activations_every": 10, "activity_window": 50, "attention_every": 10, "census_every": 50,
                  "update_ratio_every": 10, "watch_warmup": 100, "fingerprint_every": 100, "heartbeat_s": 5.0}
_F32_MAX = float(np.finfo(np.float32).max)


def _default(dtype: str):
    """A sampled table's numeric column, where a row does not give it: NaN, or -1."""
    return np.nan if dtype.startswith("f") else -1


def _as(values, dtype: str) -> np.ndarray:
    """A column as the recorder stores it: float32 saturates finite values, int32 clips."""
    if dtype == "str":
        return np.array([str(v) for v in values], dtype=object)
    x = np.asarray(values, dtype=np.float64 if dtype[0] == "f" else np.int64)
    if dtype == "f4":
        x = np.where(np.isfinite(x), np.clip(x, -_F32_MAX, _F32_MAX), x)
    elif dtype == "i4":
        x = np.clip(x, np.iinfo(np.int32).min, np.iinfo(np.int32).max)
    return x.astype(dtype)


def _leaves(names: list[str]) -> list[int]:
    return [int(not any(o != n and (n == "" or o.startswith(n + ".")) for o in names)) for n in names]


class TraceBuilder:
    """One rank's trace, built in memory and written by ``write``."""

    def __init__(self, params=(), modules=None, steps: int = 100, *, first_step: int = 0, config=None,
                 rank: int = 0, world_size: int = 1, start_unix: float = 1.7e9, step_s: float = 0.1):
        # params: names, or (name, shape) pairs (default shape: [8, 8] for a weight, else [8]).
        items = [p if isinstance(p, (tuple, list)) else (p, [8, 8] if p.endswith("weight") else [8])
                 for p in params]
        self.params = [n for n, _ in items]
        self.shapes = [list(s) for _, s in items]
        if modules is None:  # the model, and the module owning each parameter
            owners = dict.fromkeys(n.rpartition(".")[0] for n in self.params if "." in n)
            modules = [("", "Model")] + [(m, "Linear") for m in owners if m]
        self.modules = [m for m, _ in modules]
        self.types = [t for _, t in modules]
        self.steps = np.arange(first_step, first_step + steps) if np.ndim(steps) == 0 else np.asarray(steps)
        n = len(self.steps)
        self.cols: dict[str, np.ndarray] = {}
        for table in PER_STEP:
            for name, dtype, *width in LAYOUT[table]:
                shape = (n, len(self.params) if width == [P] else len(self.modules)) if width else (n,)
                fill = _FILL[f"{table}/{name}"]
                self.cols[f"{table}/{name}"] = np.full(shape, 0 if fill is None else fill,
                                                       dtype=np.float64 if dtype[0] == "f" else np.int64)
        self.cols["steps/step"][:] = self.steps
        self.cols["steps/time_s"][:] = start_unix + step_s * (np.arange(n) + 1)
        self.rows: dict[str, list[dict]] = {t: [] for t in LAYOUT if t not in PER_STEP}
        self.config = dict(DEFAULT_CONFIG if config is None else config)
        self.omitted: set[str] = set()
        self.meta = {"rank": rank, "world_size": world_size, "start_unix": start_unix}

    @classmethod
    def mlp(cls, layers: int = 3, width: int = 8, steps: int = 100, act: str = "ReLU", **kw) -> "TraceBuilder":
        """nn.Sequential(Linear, act, Linear, act, ..., Linear(width, 1)): modules "0", "1", ..."""
        modules, params = [("", "Sequential")], []
        for k in range(layers):
            out = 1 if k == layers - 1 else width
            modules.append((str(2 * k), "Linear"))
            params += [(f"{2 * k}.weight", [out, width]), (f"{2 * k}.bias", [out])]
            if k < layers - 1:
                modules.append((str(2 * k + 1), act))
        return cls(params, modules, steps, **kw)

    # -- per-step columns -------------------------------------------------------------------
    def rows_of(self, at) -> np.ndarray:
        """Row indices of the steps ``at`` names (None: every step)."""
        if at is None:
            return np.arange(len(self.steps))
        if isinstance(at, slice):
            lo = 0 if at.start is None else np.searchsorted(self.steps, at.start)
            hi = len(self.steps) if at.stop is None else np.searchsorted(self.steps, at.stop)
            return np.arange(lo, hi)[:: at.step or 1]
        want = np.atleast_1d(np.asarray(list(at) if isinstance(at, range) else at, dtype=np.int64))
        rows = np.searchsorted(self.steps, want)
        if (rows >= len(self.steps)).any() or (self.steps[np.minimum(rows, len(self.steps) - 1)] != want).any():
            raise ValueError(f"steps {want.tolist()} are not all steps of this trace")
        return rows

    def set(self, name: str, value, at=None, col=None) -> "TraceBuilder":
        """Per-step dataset ``name`` ("steps/loss", "params/grad_norm", ...) := value at ``at``
        (steps) and ``col`` (parameter or module names, for the 2-D ones). The value broadcasts;
        for a 2-D dataset a 1-D value as long as the steps, and not as the columns, is per step."""
        arr = self.cols[name]
        rows = self.rows_of(at)
        if arr.ndim == 1:
            arr[rows] = value
            return self
        names = self.params if name.startswith("params/") else self.modules
        cols = np.arange(arr.shape[1]) if col is None else \
            np.array([names.index(c) for c in ([col] if isinstance(col, str) else col)], dtype=np.int64)
        v = np.asarray(value, dtype=np.float64)
        if v.ndim == 1 and len(v) == len(rows) and len(v) != len(cols):  # one value per step
            v = v[:, None]
        arr[np.ix_(rows, cols)] = v
        return self

    def loss(self, values, at=None) -> "TraceBuilder":
        """The loss given to rec.step() (loss_given 1 on those steps: a NaN is then a NaN loss)."""
        return self.set("steps/loss", values, at).set("steps/loss_given", 1, at)

    def total_grad_norm(self, values, at=None) -> "TraceBuilder":
        """Every parameter's gradient norm, so that the norm of all together is ``values``."""
        v = np.asarray(values, dtype=np.float64) / np.sqrt(max(len(self.params), 1))
        return self.set("params/grad_norm", v, at)

    def module_index(self, module: str) -> int:
        return self.modules.index(module)

    # -- sampled tables ---------------------------------------------------------------------
    def row(self, table: str, **values) -> "TraceBuilder":
        """Append one row to a table of 1-D columns (census_groups, module_outputs, loss_checks,
        hyperparams, optimizers, ...); a module given by name is stored as its index."""
        if "module" in values and isinstance(values["module"], str):
            values["module"] = self.module_index(values["module"])
        unknown = set(values) - {c[0] for c in LAYOUT[table]}
        if unknown:
            raise KeyError(f"{table} has no column(s) {sorted(unknown)}")
        self.rows[table].append(values)
        return self

    def census(self, step: int, count: int, bytes: int = 4, shape: str = "[]", dtype: str = "float32",
               device: str = "cpu", graph: int = 0, grad_fn: str = "") -> "TraceBuilder":
        """One census group at a census step (set steps/live_tensors* yourself for its totals)."""
        return self.row("census_groups", step=step, device=device, dtype=dtype, shape=shape, graph=graph,
                        count=count, bytes=bytes, grad_fn=grad_fn)

    def _wide(self, table: str, steps, names: list[str], stats: dict, fills: dict) -> "TraceBuilder":
        """Rows of a sampled steps x names table; each stat a (rows x names) array or a dict
        {name: a value, or one per row}; names not given hold the fill value."""
        steps = list(steps)
        for k, s in enumerate(steps):
            row = {"step": s}
            for stat, fill in fills.items():
                given = stats.get(stat)
                if given is not None and not isinstance(given, dict):
                    row[stat] = np.asarray(given, dtype=np.float64)[k]
                    continue
                v = np.full(len(names), fill, dtype=np.float64)
                for name, x in (given or {}).items():
                    v[names.index(name)] = np.broadcast_to(np.asarray(x, dtype=np.float64), (len(steps),))[k]
                row[stat] = v
            self.rows[table].append(row)
        return self

    def activations(self, steps, **stats) -> "TraceBuilder":
        """Watched steps' activation statistics (mean, std, absmax, zero_frac, nonfinite) by module;
        every module not given is "not called": NaN, nonfinite -1 (0 for modules given a stat)."""
        steps = list(steps)
        given = {m for v in stats.values() if isinstance(v, dict) for m in v}
        whole = any(not isinstance(v, dict) for v in stats.values())  # (rows x modules) arrays
        stats.setdefault("nonfinite", np.zeros((len(steps), len(self.modules))) if whole else dict.fromkeys(given, 0))
        fills = {"mean": np.nan, "std": np.nan, "absmax": np.nan, "zero_frac": np.nan, "nonfinite": -1}
        return self._wide("activations", steps, self.modules, stats, fills)

    def updates(self, steps, ratio) -> "TraceBuilder":
        """Sampled update-to-weight ratios: (rows x params) or {param: value or one per row}."""
        return self._wide("updates", steps, self.params, {"ratio": ratio}, {"ratio": np.nan})

    def activity_site(self, module: str, function: str = "relu", units: int = 16, call: int = 0,
                      param: float = np.nan, unit_dim: int = 1, first_step: int = 0) -> "TraceBuilder":
        """An activation call site; its units take the next bits of activity/ever_positive."""
        offset = sum(int(s["units"]) for s in self.rows["activity_sites"])
        return self.row("activity_sites", module=module, function=function, call=call, param=param,
                        unit_dim=unit_dim, units=units, bit_offset=offset, first_step=first_step)

    def _site(self, table: str, key) -> int:
        """A site's row: ``key`` is its index, or its module's name (its first site)."""
        if isinstance(key, int):
            return key
        return next(k for k, s in enumerate(self.rows[table]) if s["module"] == self.module_index(key))

    def activity_window(self, start: int, end: int, alive=None, watched=None, seen=None,
                        saturated=None) -> "TraceBuilder":
        """A window of steps: ``alive`` {site (module name or index): how many of its first units
        were ever positive, or one bool per unit} (default: all); ``watched`` steps of the window
        (default one in ten), ``seen`` {site: steps called} (default: every watched step),
        ``saturated`` {site: share} (default NaN)."""
        sites = self.rows["activity_sites"]
        watched = max(1, (end - start + 1) // 10) if watched is None else watched
        bits = np.ones(sum(int(s["units"]) for s in sites), dtype=bool)
        seen_v = np.full(len(sites), watched)
        sat_v = np.full(len(sites), np.nan)
        for key, v in (alive or {}).items():
            s = sites[self._site("activity_sites", key)]
            a = np.arange(s["units"]) < v if np.ndim(v) == 0 else np.asarray(v, dtype=bool)
            bits[s["bit_offset"]:s["bit_offset"] + s["units"]] = a
        for key, v in (seen or {}).items():
            seen_v[self._site("activity_sites", key)] = v
        for key, v in (saturated or {}).items():
            sat_v[self._site("activity_sites", key)] = v
        packed = np.packbits(bits.astype(np.uint8), bitorder="little")
        self.rows["activity"].append({"step_start": start, "step_end": end, "steps_seen": seen_v,
                                      "steps_watched": watched, "ever_positive": packed, "saturated_frac": sat_v})
        return self

    def attention_site(self, module: str, heads: int = 4, source: str = "MultiheadAttention", call: int = 0,
                       first_step: int = 0) -> "TraceBuilder":
        offset = sum(int(s["heads"]) for s in self.rows["attention_sites"])
        return self.row("attention_sites", module=module, source=source, call=call, heads=heads,
                        head_offset=offset, first_step=first_step)

    def attention(self, steps, **stats) -> "TraceBuilder":
        """Sampled attention statistics by site (module name or index): entropy, max_weight,
        sink_share {site: a value, one per head, or rows x heads}; head_similarity, keys {site:
        a value or one per row}. Not given: NaN (keys: 16)."""
        sites = self.rows["attention_sites"]
        n_heads = sum(int(s["heads"]) for s in sites)
        steps = list(steps)
        for k, step in enumerate(steps):
            row = {"step": step}
            for stat in ("entropy", "max_weight", "sink_share", "head_similarity", "keys"):
                per_head = stat not in ("head_similarity", "keys")
                v = np.full(n_heads if per_head else len(sites), 16.0 if stat == "keys" else np.nan)
                for key, x in stats.get(stat, {}).items():
                    j = self._site("attention_sites", key)
                    x = np.asarray(x, dtype=np.float64)
                    if per_head:
                        h = int(sites[j]["heads"])
                        o = int(sites[j]["head_offset"])
                        v[o:o + h] = x[k] if x.ndim == 2 else x
                    else:
                        v[j] = x[k] if x.ndim == 1 else x
                row[stat] = v
            self.rows["attention"].append(row)
        return self

    # -- many ranks: hangs and replicas ------------------------------------------------------
    def heartbeats(self, rows) -> "TraceBuilder":
        """Heartbeat rows (a stall: no step came for a while), each a dict of ``time_unix``,
        ``step`` (in progress), ``phase`` (one of HEARTBEAT_PHASES), ``phase_s``, ``step_s``,
        ``typical_step_s`` (NaN if not given) and ``stack``: "" (not sampled, or unchanged since
        the last sample, as the recorder writes it), a JSON string, or a list of [filename,
        lineno, function, code_line] frames, innermost last."""
        for r in rows:
            r = dict(r)
            if r.get("phase") not in HEARTBEAT_PHASES:
                raise ValueError(f"heartbeat phase must be one of {HEARTBEAT_PHASES}, got {r.get('phase')!r}")
            stack = r.get("stack", "")
            if not isinstance(stack, str):
                r["stack"] = json.dumps([[str(f), int(n), str(fn), str(code)] for f, n, fn, code in stack])
            self.row("heartbeats", **r)
        return self

    def fingerprints(self, steps, bits) -> "TraceBuilder":
        """Replica fingerprints at ``steps``: ``bits`` (rows x parameters) int64 checksums, or
        {param: one value, or one per row} with every other parameter 0."""
        steps = [int(s) for s in steps]
        if isinstance(bits, dict):
            arr = np.zeros((len(steps), len(self.params)), dtype=np.int64)
            for name, v in bits.items():
                arr[:, self.params.index(name)] = np.broadcast_to(np.asarray(v, dtype=np.int64), (len(steps),))
        else:
            arr = np.asarray(bits, dtype=np.int64).reshape(len(steps), len(self.params))
        for k, s in enumerate(steps):
            self.rows["fingerprints"].append({"step": s, "bits": arr[k]})
        return self

    # -- the file ---------------------------------------------------------------------------
    def without(self, *names: str) -> "TraceBuilder":
        """Leave datasets ("steps/lr") or whole tables ("activity") out, as older traces do."""
        self.omitted.update(names)
        return self

    def attrs(self, **values) -> "TraceBuilder":
        """Root attributes to set or override (closed=False: a killed job's trace)."""
        self.meta.update(values)
        return self

    def root_attrs(self) -> dict:
        """The root attributes a closed trace of the recorder has, with ``attrs``' overrides."""
        start = float(self.meta["start_unix"])
        model = self.types[0] if self.types else ""
        return {
            "format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "created_by": "torchautopsy 0.1.0",
            "torch_version": "none (tests/tracebuilder.py)", "python_version": "3", "host": "tracebuilder",
            "pid": os.getpid(), "start_time": _dt.datetime.fromtimestamp(start, _dt.timezone.utc).isoformat(),
            "device": "cpu", "rss_source": "statm" if (self.cols["steps/rss_bytes"] >= 0).any() else "none",
            "model_class": model, "model_summary": f"{model}(synthetic)",
            "n_parameters": sum(int(np.prod(s)) for s in self.shapes),
            "config": json.dumps(self.config, sort_keys=True), "command": "tests/tracebuilder.py",
            "nccl_env": "{}",
            "closed": True, "end_reason": "closed",
            "end_unix": float(np.nanmax(self.cols["steps/time_s"], initial=start)),
            "n_steps_recorded": len(self.steps), "attempt": 1, "previous_file": "", "dropped_steps": 0,
            "local_grad_norms": "no DDP or FSDP2 module", **self.meta,
        }

    def write(self, run_dir, rank: int | None = None, attempt: int = 1) -> str:
        """Write ``run_dir/rank{N}.h5`` (``rank{N}.attempt{K}.h5`` for attempt K > 1); its path."""
        rank = self.meta["rank"] if rank is None else rank
        os.makedirs(run_dir, exist_ok=True)
        name = f"rank{rank}.h5" if attempt == 1 else f"rank{rank}.attempt{attempt}.h5"
        path = os.path.join(os.fspath(run_dir), name)
        attrs = {**self.root_attrs(), "rank": rank, "attempt": attempt}
        with h5py.File(path, "w", libver="latest") as f:
            for k, v in attrs.items():
                if k in self.omitted:
                    continue
                if isinstance(v, str):  # variable-length UTF-8, as the recorder stores them
                    f.attrs.create(k, v, dtype=_STR)
                else:
                    f.attrs[k] = v
            n = len(self.params)
            static = {"params": {"name": (self.params, "str"), "shape": ([json.dumps(s) for s in self.shapes], "str"),
                                 "numel": ([int(np.prod(s)) for s in self.shapes], "i8"),
                                 "dtype": (["float32"] * n, "str"), "shards": ([1] * n, "i8"),
                                 "requires_grad": ([1] * n, "i8")},
                      "modules": {"name": (self.modules, "str"), "type": (self.types, "str"),
                                  "is_leaf": (_leaves(self.modules), "i8"),
                                  "class_source": ([""] * len(self.modules), "str"),
                                  "forward_source": ([""] * len(self.modules), "str")}}
            for table, cols in static.items():
                for col, (values, dtype) in cols.items():
                    if f"{table}/{col}" not in self.omitted and table not in self.omitted:
                        f.create_dataset(f"{table}/{col}", data=_as(values, dtype).reshape(-1),
                                         dtype=_STR if dtype == "str" else dtype)
            for table, cols in LAYOUT.items():
                if table in self.omitted:
                    continue
                f.require_group(table)
                for col, dtype, *width in cols:
                    if f"{table}/{col}" in self.omitted:
                        continue
                    if table in PER_STEP:
                        data = self.cols[f"{table}/{col}"]
                    else:
                        data = [r.get(col, _default(dtype) if dtype != "str" else "")
                                for r in self.rows[table]]
                    self._dataset(f[table], col, dtype, width[0] if width else None, data)
        return path

    def _dataset(self, g: h5py.Group, col: str, dtype: str, width, data) -> None:
        """One table column, chunked and resizable along its rows as the recorder makes it."""
        if width is None:
            arr = _as(data, dtype).reshape(-1)
            chunks = (256,) if dtype == "str" else (1024,)
            g.create_dataset(col, data=arr, maxshape=(None,), chunks=chunks, dtype=_STR if dtype == "str" else dtype)
            return
        fill = np.nan if dtype[0] == "f" else 0
        if width == G:  # rows as wide as the widest, padded with the fill value
            w = max([len(np.atleast_1d(r)) for r in data], default=0)
            arr = np.full((len(data), w), fill)
            for k, r in enumerate(data):
                arr[k, :len(np.atleast_1d(r))] = r
            maxshape, chunks = (None, None), (128, 32)
        else:
            w = len(self.params) if width == P else len(self.modules)
            # (int64 checksums stay exact: not through float64)
            arr = np.asarray(data, dtype=np.float64 if dtype[0] == "f" else np.int64).reshape(len(data), w)
            item = np.dtype(dtype).itemsize
            maxshape = (None, w or None)
            chunks = (int(max(16, min(4096, 32 * 1024 // max(1, w * item)))), max(1, w))
        g.create_dataset(col, data=_as(arr, dtype), maxshape=maxshape, chunks=chunks, fillvalue=fill)


def findings(run_dir, kind: str | None = None, cfg=None) -> list:
    """The real analyzer's findings on ``run_dir`` (of one kind if given). A crash of that
    detector (the runner's analyzer_error finding) fails the test rather than pass as a finding."""
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.analyzer.trace import load

    found = analyze(load(os.fspath(run_dir)), cfg)
    crashed = [f for f in found if f.kind == "analyzer_error" and kind in (None, f.evidence.get("detector"))]
    assert not crashed, crashed[0].summary + "\n" + crashed[0].evidence.get("traceback", "")
    from tests.analyzer.test_evidence_contract import undeclared_keys
    assert not undeclared_keys(found), undeclared_keys(found)  # evidence keys its kind declares
    return [f for f in found if kind is None or f.kind == kind]
