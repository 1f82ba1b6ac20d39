"""The mutators' tools: marking a mutator's variants, and editing an HDF5 file in place (a dataset
replaced whole, strings written as UTF-8)."""

from __future__ import annotations

import h5py
import numpy as np

STR = h5py.string_dtype("utf-8")


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
