"""A run directory of N copies of one tiny real trace, each given its own rank (issue 38, point 4;
the measurements in benchmarks/README.md, "Thousands of small rank files").

    python benchmarks/many_rank_files.py OUT_DIR N

Records a 2-layer MLP for 3 steps with the Recorder (tests/training.py), rewrites the trace with
contiguous datasets (~150 KB: the recorder's chunks hold room for many more steps), then copies
it as rank0.h5 .. rank{N-1}.h5, each with its own ``rank`` and ``world_size`` attributes as DDP
writes them (the reader takes a file's rank from its ``rank`` attribute)."""

from __future__ import annotations

import os
import sys
import tempfile

import h5py
import numpy as np


def base_trace(out: str) -> str:
    """A tiny real trace, rewritten contiguous, at ``out``."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests.training import train

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with tempfile.TemporaryDirectory() as tmp:
        train(model, tmp, 3, torch.randn(4, 8))
        with h5py.File(os.path.join(tmp, "rank0.h5"), "r") as src, h5py.File(out, "w") as dst:
            _copy(src, dst)
    return out


def _copy(src: h5py.Group, dst: h5py.Group) -> None:
    for k, v in src.attrs.items():
        dst.attrs[k] = v
    for name, obj in src.items():
        if isinstance(obj, h5py.Group):
            _copy(obj, dst.create_group(name))
        else:
            ds = dst.create_dataset(name, data=obj[()], dtype=obj.dtype)
            for k, v in obj.attrs.items():
                ds.attrs[k] = v


RANK, WORLD = 0x5EA1_0000_0000_0001, 0x5EA1_0000_0000_0002  # (placeholders, found in the bytes)


def many(run: str, n: int) -> str:
    """``run`` holding rank0.h5 .. rank{n-1}.h5: copies of a base trace whose ``rank`` and
    ``world_size`` attributes are placeholders, each copy with its own values written over them
    (the base is written without object header checksums, so the bytes are the values)."""
    os.makedirs(run, exist_ok=True)
    base = base_trace(os.path.join(run, "base.tmp"))
    with h5py.File(base, "r+") as f:
        f.attrs["rank"], f.attrs["world_size"] = np.int64(RANK), np.int64(WORLD)
    with open(base, "rb") as f:
        data = bytearray(f.read())
    os.remove(base)
    at = {v: data.find(np.int64(v).tobytes()) for v in (RANK, WORLD)}
    assert all(i >= 0 for i in at.values()) and data.count(np.int64(RANK).tobytes()) == 1
    data[at[WORLD]:at[WORLD] + 8] = np.int64(n).tobytes()
    for r in range(n):
        data[at[RANK]:at[RANK] + 8] = np.int64(r).tobytes()
        with open(os.path.join(run, f"rank{r}.h5"), "wb") as f:
            f.write(data)
    with h5py.File(os.path.join(run, f"rank{n - 1}.h5"), "r") as f:
        assert (f.attrs["rank"], f.attrs["world_size"]) == (n - 1, n)
    return run


if __name__ == "__main__":
    many(sys.argv[1], int(sys.argv[2]))
