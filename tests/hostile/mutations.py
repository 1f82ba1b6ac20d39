"""Seeded mutators that turn a real sample trace into a damaged or hostile copy (issue 20).

Every class is a function ``(path or h5py.File, rng, kind) -> detail`` that damages a copy of a
sample trace in place and says what it did; the seed picks the variant (``kind``, one of the
function's KINDS) and seeds the rng for the rest. ``make_trial(cls, seed, dir)`` is deterministic
in (cls, seed), so a failure reproduces with

    python -m tests.hostile.mutations CLASS SEED OUT_DIR     # writes OUT_DIR/rank0.h5

Byte-level damage (truncation, flips, overwrites) works on raw bytes; structural damage with
h5py. Nothing here reaches outside the file (external links/storage, virtual datasets and
plugin filters have their own tests).
"""

from __future__ import annotations

import functools
import shutil
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
BASES = sorted(p.parent.name for p in SAMPLES.glob("*/rank0.h5"))
STR = h5py.string_dtype("utf-8")

from tests.hostile.targets import (  # noqa: E402  (data, kept apart from the mutators)
    SCRIPT, IMG, MD_LINK, PAYLOADS, LONG_INT, DEEP_JSON, STEP_DATASETS, INDEX_DATASETS, JSON_TEXTS, NAME_LISTS, PER_STEP, MEMORY_ROWS)


def hostile_ints(dtype) -> list[int]:
    info = np.iinfo(dtype)
    return [v for v in (-1, -2, info.min, info.max, 2**62, 2**40, 2**31 - 1, -(2**40)) if info.min <= v <= info.max]


# -- helpers ---------------------------------------------------------------------------------------
def kinds(*names):
    """Mark a mutator with its variants (KINDS); the seed picks one (seed mod their number)."""
    def mark(fn):
        fn.KINDS = list(names[0]) if len(names) == 1 and not isinstance(names[0], str) else list(names)
        return fn
    return mark


def datasets(f: h5py.File, nonempty: bool = False) -> list[str]:
    out: list[str] = []
    f.visititems(lambda n, o: out.append(n) if isinstance(o, h5py.Dataset) and (o.size or not nonempty) else None)
    return sorted(out)


def is_str(ds) -> bool:
    return h5py.check_string_dtype(ds.dtype) is not None


def pick(rng, items):
    return items[int(rng.integers(len(items)))]


def replace(f, name, **kw):
    """Delete a dataset and create another in its place (h5py cannot change dtype or rank)."""
    if name in f:
        del f[name]
    return f.create_dataset(name, **kw)


def as_bytes(v) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode("utf-8")


def texts(values, shape) -> np.ndarray:
    """An object array of UTF-8 bytes (h5py writes them as they are, invalid UTF-8 included)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = [as_bytes(v) for v in values]
    return arr.reshape(shape)


def existing(f, names) -> list[str]:
    return [n for n in names if n in f and isinstance(f[n], h5py.Dataset)]


# -- byte-level damage -----------------------------------------------------------------------------
@kinds("head", "anywhere", "tail")
def truncate(path, rng, kind):
    data = Path(path).read_bytes()  # metadata sits at both ends of the file
    n = {"head": int(rng.integers(0, 8192)), "anywhere": int(rng.integers(0, len(data))),
         "tail": len(data) - int(rng.integers(1, 8192))}[kind]
    Path(path).write_bytes(data[:n])
    return f"cut at byte {n} of {len(data)}"


@kinds("anywhere", "first_64k")
def byte_flips(path, rng, kind):
    data = bytearray(Path(path).read_bytes())
    k = int(rng.integers(1, 65))
    span = len(data) if kind == "anywhere" else min(len(data), 65536)
    pos = rng.integers(0, span, size=k)
    for p in pos:
        data[int(p)] ^= int(rng.integers(1, 256))
    Path(path).write_bytes(bytes(data))
    return f"{k} bytes flipped in the first {span} (at {sorted(int(p) for p in pos)[:6]}...)"


@kinds("random", "zeros", "ff")
def overwrite_512(path, rng, kind):
    data = bytearray(Path(path).read_bytes())
    off = int(rng.integers(0, len(data) - 512))
    data[off:off + 512] = {"random": rng.integers(0, 256, 512, dtype=np.uint8).tobytes(),
                           "zeros": bytes(512), "ff": b"\xff" * 512}[kind]
    Path(path).write_bytes(bytes(data))
    return f"512 {kind} bytes at offset {off}"


# -- structural damage (h5py, in place) ------------------------------------------------------------
@kinds("random", "group", "required", "lazy_time_s")
def delete(f, rng, kind):
    if kind == "group":
        victims = [pick(rng, sorted(f.keys()))]
    elif kind == "required":
        victims = [pick(rng, PER_STEP + NAME_LISTS + ["steps/loss", "blobs/bytes"])]
    elif kind == "lazy_time_s":  # read lazily, after load() succeeded (the case)
        victims = ["steps/time_s"]
    else:
        victims = [pick(rng, datasets(f)) for _ in range(int(rng.integers(1, 4)))]
    for v in dict.fromkeys(victims):
        if v in f:
            del f[v]
    return f"deleted {sorted(set(victims))}"


@kinds("to_str", "to_int", "to_float", "fixed_bytes", "swap_int_float", "complex", "bool",
       "uint64_max", "compound")
def wrong_dtype(f, rng, kind):
    strs = [n for n in datasets(f) if is_str(f[n])]
    nums = [n for n in datasets(f) if not is_str(f[n])]
    key = existing(f, NAME_LISTS + PER_STEP + STEP_DATASETS)
    pool = strs if kind in ("to_int", "to_float") else nums
    name = pick(rng, [n for n in key if n in pool] if rng.random() < 0.5 else pool)
    old, was = f[name][()], f[name].dtype
    shape = old.shape
    make = {  # strings where numbers go and back, float where int and back, and odder types
        "to_str": lambda: texts([str(v) for v in old.ravel()], shape),
        "to_int": lambda: np.arange(old.size, dtype=np.int64).reshape(shape),
        "to_float": lambda: rng.standard_normal(old.size).reshape(shape),
        "fixed_bytes": lambda: np.full(shape, b"abc", dtype="S3"),
        "swap_int_float": lambda: (old.astype(np.float64) + 0.5 if old.dtype.kind in "iub"
                                   else np.nan_to_num(old).astype(np.int64)),
        "complex": lambda: old.astype(np.complex128),
        "bool": lambda: np.ones(shape, dtype=bool),
        "uint64_max": lambda: np.full(shape, np.iinfo(np.uint64).max, dtype=np.uint64),
        "compound": lambda: np.zeros(shape, dtype=[("a", "<i8"), ("b", "<f8")]),
    }
    replace(f, name, data=make[kind](), **({"dtype": STR} if kind == "to_str" else {}))
    return f"{name} {was}->{kind}"


@kinds("add_dim", "drop_dim", "scalar", "three_d", "empty", "null", "width")
def wrong_shape(f, rng, kind):
    name = pick(rng, datasets(f) if rng.random() < 0.5 else existing(f, NAME_LISTS + PER_STEP + STEP_DATASETS))
    old = f[name][()]
    if kind == "null":
        replace(f, name, data=h5py.Empty(f[name].dtype))
        return f"{name}: null dataspace"
    if kind == "add_dim":
        new = np.repeat(old[..., None], 3, axis=-1)
    elif kind in ("drop_dim", "scalar"):
        new = old.ravel() if old.ndim > 1 and kind == "drop_dim" else \
            (old.ravel()[0] if old.size else np.zeros((), old.dtype))
    elif kind == "three_d":
        new = np.resize(old, (2, 2, 2)) if old.size else np.zeros((2, 2, 2), old.dtype)
    elif kind == "empty":
        new = old[:0] if old.ndim else np.zeros((0,), old.dtype)
        if rng.random() < 0.5 and new.ndim == 2:
            new = np.zeros((0, 0), old.dtype)
    else:  # another number of columns than names (or a 1-D column that gains some)
        w = int(pick(rng, [0, 1, 7, 1000]))
        rows = old.shape[0] if old.ndim else 1
        new = np.resize(old, (rows, w)) if old.size else np.zeros((rows, w), old.dtype)
    kw = {"dtype": STR} if is_str(f[name]) else {}
    if kw and isinstance(new, np.ndarray) and new.ndim == 0:
        new = as_bytes(new.item())
    replace(f, name, data=new, **kw)
    return f"{name} {old.shape}->{kind} {np.shape(new)}"


def set_len(f, name, axis, n):
    """Cut or pad (repeating the last entry) one axis of a dataset to n."""
    old = f[name][()]
    if old.shape[axis] == 0:
        shape = list(old.shape)
        shape[axis] = 1
        old = np.resize(texts(["x"], (1,)) if is_str(f[name]) else np.zeros(1, old.dtype), shape)
    new = np.take(old, np.minimum(np.arange(n), old.shape[axis] - 1), axis=axis)
    replace(f, name, data=new, maxshape=(None,) + new.shape[1:], chunks=True,
            **({"dtype": STR} if is_str(f[name]) else {}))


@kinds("name_list", "column", "width")
def length_mismatch(f, rng, kind):
    if kind == "name_list":
        name, axis = pick(rng, existing(f, NAME_LISTS)), 0
    else:
        name = pick(rng, [n for n in datasets(f, nonempty=True) if f[n].ndim == (2 if kind == "width" else 1)])
        axis = 1 if kind == "width" else 0
    n = f[name].shape[axis]
    new = int(pick(rng, [0, 1, max(n - 1, 0), n + 1, 2 * n + 3, n + 1000]))
    set_len(f, name, axis, new)
    return f"{name} axis {axis}: {n} -> {new}"


@kinds("nan_one", "inf_one", "-inf_one", "mixed_one", "nan_all", "inf_all", "mixed_all")
def nonfinite(f, rng, kind):
    fill, mode = kind.split("_")
    floats = [n for n in datasets(f, nonempty=True) if f[n].dtype.kind == "f"]
    victims = floats if mode == "all" else [pick(rng, floats)]
    pool = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3.4e38, -1.0, 1e-45]
    for name in victims:
        ds = f[name]
        ds[...] = rng.choice(pool, size=ds.shape) if fill == "mixed" else np.full(ds.shape, float(fill))
    return f"{fill} in {len(victims)} float dataset(s){'' if mode == 'all' else ': ' + victims[0]}"


@kinds("negative", "huge", "int64_max", "int64_min", "decreasing", "duplicate", "shuffled", "gaps")
def step_numbers(f, rng, kind):
    names = [n for n in existing(f, STEP_DATASETS) if f[n].size]
    victims = names if rng.random() < 0.3 else [pick(rng, names)]
    for name in victims:
        v = f[name][()].astype(np.int64)
        n = v.size
        new = {"negative": -np.arange(n) - 1, "huge": 2**62 + np.arange(n),
               "int64_max": np.full(n, np.iinfo(np.int64).max), "int64_min": np.full(n, np.iinfo(np.int64).min),
               "decreasing": np.sort(v.ravel())[::-1], "duplicate": np.full(n, v.ravel()[0]),
               "shuffled": rng.permutation(v.ravel()), "gaps": np.arange(n) * 10**15}[kind]
        info = np.iinfo(f[name].dtype)
        f[name][...] = np.clip(new, info.min, info.max).reshape(v.shape).astype(f[name].dtype)
    return f"{kind} step numbers in {victims if len(victims) < 4 else f'{len(victims)} datasets'}"


@kinds("resize_one", "resize_per_step", "resize_all", "recreate_one", "recreate_names")
def huge_dims(f, rng, kind):
    big = 2**40
    if kind.startswith("resize"):
        resizable = [n for n in datasets(f) if f[n].maxshape and f[n].maxshape[0] is None]
        victims = {"resize_one": [pick(rng, resizable)], "resize_per_step": existing(f, PER_STEP),
                   "resize_all": resizable}[kind]
        for n in victims:
            f[n].resize(big, axis=0)
            if f[n].ndim == 2 and f[n].maxshape[1] is None and rng.random() < 0.5:
                f[n].resize(2**30, axis=1)
        return f"{kind}: {len(victims)} dataset(s) to 2**40 rows ({victims[0]}...)"
    name = pick(rng, existing(f, NAME_LISTS) if kind == "recreate_names" else datasets(f))
    trail, dtype = f[name].shape[1:], f[name].dtype
    replace(f, name, shape=(big,) + trail, dtype=dtype, chunks=(1024,) + tuple(max(d, 1) for d in trail),
            maxshape=(None,) * (1 + len(trail)))
    return f"{name} recreated as shape {(big,) + trail}, never written"


@functools.lru_cache(maxsize=4)
def deflated_zeros(n: int) -> bytes:
    c = zlib.compressobj(9 if n <= 64 << 20 else 1)  # level 9 is slow on the 2 GiB one-chunk bomb
    piece = bytes(min(n, 1 << 22))
    out = [c.compress(piece[:min(len(piece), n - i)]) for i in range(0, n, len(piece))]
    return b"".join(out) + c.flush()


def bomb(f, name, total=2**31, one_chunk=False):
    """Replace ``name`` by a gzip dataset of ``total`` bytes of zeros: one precompressed chunk
    written again and again (write_direct_chunk), so it is fast and a few MB on disk."""
    dt = f[name].dtype if not is_str(f[name]) else np.dtype(np.int64)
    trail = f[name].shape[1:]
    row = dt.itemsize * int(np.prod(trail, dtype=np.int64)) or 1
    rows = total // row
    chunk = rows if one_chunk else max(1, (4 << 20) // row)
    rows -= rows % chunk
    blob = deflated_zeros(chunk * row)
    ds = replace(f, name, shape=(rows,) + trail, maxshape=(None,) + trail, dtype=dt,
                 chunks=(chunk,) + trail, compression="gzip")
    for i in range(rows // chunk):
        ds.id.write_direct_chunk((i * chunk,) + (0,) * len(trail), blob)


@kinds("params/numel", "modules/is_leaf", "histogram_bins", "histogram_params/param",
       "blobs/bytes", "snapshots/bytes", "steps/loss", "per_step", "one_chunk", "profile_gzip")
def compression_bomb(f, rng, kind):
    if kind == "profile_gzip":  # the profiler's Chrome trace is gzip: 2 GiB in 512 gzip members
        import gzip
        data = gzip.compress(bytes(4 << 20), compresslevel=9) * 512
        blobs = f["blobs/bytes"]
        off = blobs.shape[0]
        blobs.resize(off + len(data), axis=0)
        blobs[off:] = np.frombuffer(data, dtype=np.uint8)
        f["profile_windows/trace_offset"][0] = off
        f["profile_windows/trace_nbytes"][0] = len(data)
        return f"profiler window 0 -> {len(data)} bytes of gzip members inflating to 2 GiB"
    victims = {"histogram_bins": ["histogram_bins/lower", "histogram_bins/upper"],
               "per_step": existing(f, PER_STEP) + [f"steps/{k}" for k in f["steps"].keys()],
               "one_chunk": [pick(rng, ["steps/step", "params/numel", "params/grad_norm"])]}.get(kind, [kind])
    for v in dict.fromkeys(victims):
        bomb(f, v, one_chunk=kind == "one_chunk")
    return f"2 GiB of gzip zeros{' in one chunk' if kind == 'one_chunk' else ''} in {victims[0]}" \
           + (f" and {len(victims) - 1} more" if len(victims) > 1 else "")


@kinds("params", "modules", "params_and_columns")
def many_names(f, rng, kind):
    n = 3_000_000
    which = "modules/name" if kind == "modules" else "params/name"
    replace(f, which, data=texts([f"layer{i}.weight" for i in range(n)], (n,)), dtype=STR)
    if kind == "params_and_columns":  # columns to match: declared, never written
        rows = f["steps/step"].shape[0]
        replace(f, "params/numel", data=np.ones(n, np.int64))
        for s in PER_STEP[1:5]:
            replace(f, s, shape=(rows, n), dtype=f[s].dtype, chunks=(1, 1 << 18), maxshape=(None, n))
        return f"{n:,} parameter names, stats declared {rows} x {n:,}"
    return f"{n:,} names in {which}"


@kinds("names", "all_strings", "one", "duplicates")
def hostile_names(f, rng, kind):
    strs = [n for n in datasets(f, nonempty=True) if is_str(f[n]) and f[n].ndim == 1]
    victims = {"names": ["params/name", "modules/name"], "all_strings": strs, "one": [pick(rng, strs)],
               "duplicates": ["params/name", "modules/name"]}[kind]
    for name in victims:
        n = f[name].shape[0]
        if kind == "duplicates":  # every name the same payload
            vals = [PAYLOADS[int(rng.integers(len(PAYLOADS)))]] * n
        else:  # each a payload, unique by its index; the first entries cycle through all of them
            start = int(rng.integers(len(PAYLOADS)))
            vals = [as_bytes(PAYLOADS[(start + i) % len(PAYLOADS)]) + str(i).encode() for i in range(n)]
        replace(f, name, data=texts(vals, (n,)), dtype=STR, maxshape=(None,), chunks=True)
    return f"{kind}: {len(victims)} string dataset(s) ({victims[0]}...)"


ATTR_VALUES = {
    "rank": ["0", "zero", -1, 2**62, np.array([0, 1]), 1.5, np.nan],
    "world_size": [2**62, "many", -3, np.nan],
    "schema_version": ["2", 2.0, -1, np.array([2]), 10**18],
    "model_class": ["M" * 100_000, SCRIPT + IMG, "\x1b]8;;http://evil\x1b\\x\x1b]8;;\x1b\\\x07\r\x9b"],
    "config": ["{not json", "[1, 2]", '{"activations_every": "x"}', DEEP_JSON, LONG_INT, "null"],
    "start_unix": ["yesterday", np.nan, 1e300, -1e300], "start_time": ["T" * 100_000, "\x1b[2J"],
    "n_parameters": ["many", 2**63 - 1, -5, 1e300], "closed": ["yes", np.array([1, 0])],
    "end_reason": [SCRIPT, "exception: \x1b[31mboom\r\n" * 3], "host": [MD_LINK, "h\x9b\x07"],
    "created_by": [IMG], "torch_version": ["\x1b[31m"], "command": [MD_LINK + "\n" * 50],
    "device": [SCRIPT], "model_summary": ["S\n" * 40_000 + SCRIPT], "dropped_steps": ["x", 2**62, -1],
    "n_steps_recorded": [2**62, "x"], "end_unix": ["later", np.inf],
}


@kinds(f"{k}#{i}" for k, vs in ATTR_VALUES.items() for i in range(len(vs)))
def attrs(f, rng, kind):
    """Sets the attribute value ``kind`` names ("key#index"), and half the time one more at random."""
    done = [kind]
    if rng.random() < 0.5:
        done.append(pick(rng, attrs.KINDS))
    for k in done:
        key, i = k.split("#")
        f.attrs[key] = ATTR_VALUES[key][int(i)]
    return "; ".join(f"{k}={str(ATTR_VALUES[k.split('#')[0]][int(k.split('#')[1])])[:40]!r}" for k in done)


@kinds("self_loop", "pair_loop", "group_loop", "hard_cycle", "dangling")
def links(f, rng, kind):
    name = pick(rng, existing(f, NAME_LISTS + PER_STEP + ["steps/time_s"]))
    if kind in ("group_loop", "hard_cycle"):
        name = pick(rng, ["steps", "params", "modules", "activations", "tensors"][:5 if kind == "group_loop" else 3])
    if kind == "hard_cycle":  # a group that contains itself
        f[f"{name}/again"] = f[name]
        return f"{kind} at {name}"
    del f[name]
    if kind == "pair_loop":
        f[name] = h5py.SoftLink("/loop_b")
        f["loop_b"] = h5py.SoftLink("/" + name)
    else:  # a link to itself (a dataset's or a whole group's), or to nothing
        f[name] = h5py.SoftLink("/no/such/thing" if kind == "dangling" else "/" + name)
    return f"{kind} at {name}"


@kinds(f"[{LONG_INT}]", DEEP_JSON, "[1e999]", "[-1]", "[4611686018427387904, 4611686018427387904]",
       "NaN", '{"a": ' * 5000, "[1.5]", '["x"]', "null", "", "{}", f'{{"k": {LONG_INT}}}')
def json_texts(f, rng, kind):
    name = pick(rng, [n for n in existing(f, JSON_TEXTS) if f[n].size])
    n = f[name].shape[0]
    replace(f, name, data=texts([kind] * n, (n,)), dtype=STR, maxshape=(None,), chunks=True)
    return f"{name} = {kind[:30]!r}..."


@kinds(*INDEX_DATASETS)
def index_values(f, rng, kind):
    if kind not in f or not f[kind].size:
        return f"{kind}: absent or empty in this trace, left alone"
    ds = f[kind]
    v = int(pick(rng, hostile_ints(ds.dtype)))
    if rng.random() < 0.5:
        ds[...] = np.full(ds.shape, v, dtype=ds.dtype)
        return f"{kind}[:] = {v}"
    i = int(rng.integers(ds.shape[0]))
    ds[i] = v
    return f"{kind}[{i}] = {v}"


def add_memory_snapshot(f):
    for table, cols in MEMORY_ROWS.items():
        for col, vals in cols.items():
            name = f"{table}/{col}"
            if isinstance(vals[0], str):
                replace(f, name, data=texts(vals, (len(vals),)), dtype=STR, maxshape=(None,), chunks=True)
            else:
                dt = f[name].dtype if name in f else np.int64
                replace(f, name, data=np.asarray(vals, dtype=dt), maxshape=(None,), chunks=True)


@kinds("n_device_traces", "long_int", "deep_json", "json_not_dict", "all_keys", "stack_index",
       "stack_span", "frame_index", "segment_index", "trace_device", "n_device_traces_neg",
       "huge_sizes", "override_keys")
def memory(f, rng, kind):
    if kind in ("n_device_traces", "n_device_traces_neg"):  # the column is int32: 2**40 needs int64
        replace(f, "memory_snapshots/n_device_traces", data=np.array([2**40 if kind == "n_device_traces" else -5]))
        return f"n_device_traces = {f['memory_snapshots/n_device_traces'][0]}"
    if kind in ("long_int", "deep_json", "json_not_dict", "override_keys"):
        name = pick(rng, ["memory_snapshots/extra", "memory_snapshots/allocator_settings", "memory_segments/extra",
                          "memory_blocks/extra", "memory_trace/extra", "memory_frames/extra"])
        value = {"long_int": f'{{"x": {LONG_INT}}}', "deep_json": DEEP_JSON, "json_not_dict": f"[{LONG_INT[:20]}]",
                 "override_keys": '{"segments": 5, "device_traces": "x", "size": "huge", "frames": 3}'}[kind]
        n = f[name].shape[0]
        replace(f, name, data=texts([value] * n, (n,)), dtype=STR)
        return f"{name} = {value[:30]!r}"
    name = pick(rng, {
        "all_keys": ["memory_snapshots/keys", "memory_segments/keys", "memory_blocks/keys", "memory_trace/keys"],
        "stack_index": ["memory_segments/stack", "memory_blocks/stack", "memory_trace/stack"],
        "stack_span": ["memory_stacks/first", "memory_stacks/length"], "frame_index": ["memory_stack_frames/frame"],
        "segment_index": ["memory_blocks/segment"], "trace_device": ["memory_trace/device"],
        "huge_sizes": ["memory_blocks/size", "memory_trace/size", "memory_segments/total_size"]}[kind])
    v = -1 if kind == "all_keys" else int(pick(rng, hostile_ints(f[name].dtype)))
    f[name][...] = np.full(f[name].shape, v, dtype=f[name].dtype)
    return f"{name}[:] = {v}"


@kinds("untouched")
def control(f, rng, kind):  # the harness must pass an untouched trace
    return "untouched copy"


# name -> (mutator, works on raw bytes, needs memory snapshot rows)
MUTATIONS = {
    "control": (control, False, False), "control_memory": (control, False, True),
    **{fn.__name__: (fn, True, False) for fn in (truncate, byte_flips, overwrite_512)},
    **{fn.__name__: (fn, False, False) for fn in (
        delete, wrong_dtype, wrong_shape, length_mismatch, nonfinite, step_numbers, huge_dims, compression_bomb,
        many_names, hostile_names, attrs, links, json_texts, index_values)},
    "memory": (memory, False, True),
}


def kind_of(cls: str, seed: int) -> str:
    kinds = MUTATIONS[cls][0].KINDS
    return kinds[seed % len(kinds)]


def seed_for(cls: str, kind: str) -> int:
    """The smallest seed whose trial is of that variant (the tests name the issue's cases so)."""
    return MUTATIONS[cls][0].KINDS.index(kind)


@dataclass
class Trial:
    cls: str
    seed: int
    run_dir: Path
    base: str
    detail: str
    has_memory: bool

    @property
    def label(self) -> str:
        return f"{self.cls} seed={self.seed} base={self.base}: {self.detail}"


def make_trial(cls: str, seed: int, out_dir) -> Trial:
    """``out_dir/rank0.h5``: a sample trace damaged by mutation class ``cls`` with ``seed``."""
    fn, raw, needs_memory = MUTATIONS[cls]
    rng = np.random.default_rng([seed, zlib.crc32(cls.encode())])
    base = pick(rng, BASES)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "rank0.h5"
    shutil.copyfile(SAMPLES / base / "rank0.h5", path)
    if needs_memory:
        with h5py.File(path, "r+") as f:
            add_memory_snapshot(f)
    if raw:
        detail = fn(path, rng, kind_of(cls, seed))
    else:
        with h5py.File(path, "r+") as f:
            detail = fn(f, rng, kind_of(cls, seed))
    return Trial(cls, seed, out_dir, base, detail, needs_memory)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in MUTATIONS:
        sys.exit(f"usage: python -m tests.hostile.mutations CLASS SEED OUT_DIR\nclasses: {', '.join(MUTATIONS)}")
    t = make_trial(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    print(f"{t.run_dir / 'rank0.h5'}: {t.label}")
