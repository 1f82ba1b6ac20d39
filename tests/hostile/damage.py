"""Mutators that damage a trace's bytes or its HDF5 structure (tests/hostile/mutations.py has the
registry): truncation, flips, overwrites; datasets deleted, retyped, reshaped, cut to other lengths;
non-finite values, bad step numbers, huge dimensions, compression bombs."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import h5py
import numpy as np

from tests.hostile.h5edit import STR, as_bytes, datasets, existing, is_str, kinds, pick, replace, texts
from tests.hostile.targets import NAME_LISTS, PER_STEP, STEP_DATASETS

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
    piece = bytes(min(n, 1 << 22))
    if n > 64 << 20 and n % len(piece) == 0:
        return _repeated_zeros(n, piece)
    c = zlib.compressobj(9 if n <= 64 << 20 else 1)  # level 9 is slow on gigabytes
    out = [c.compress(piece[:min(len(piece), n - i)]) for i in range(0, n, len(piece))]
    return b"".join(out) + c.flush()


def _repeated_zeros(n: int, piece: bytes) -> bytes:
    """A zlib stream of n zeros without deflating them all (that took 3.7 CPU-s for the 2 GiB
    one-chunk bomb): after a full flush the compressor forgets what came before, so each further
    piece deflates to the same bytes; the stream ends with an empty final block and the Adler-32
    of n zeros (its low half stays 1, its high half adds 1 a byte). zlib checks it on inflate."""
    c = zlib.compressobj(1)
    first = c.compress(piece) + c.flush(zlib.Z_FULL_FLUSH)  # (with the zlib header)
    again = c.compress(piece) + c.flush(zlib.Z_FULL_FLUSH)
    end = c.flush()[:-4]  # the final block, without the checksum of only two pieces
    return first + again * (n // len(piece) - 1) + end + ((n % 65521) << 16 | 1).to_bytes(4, "big")


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
