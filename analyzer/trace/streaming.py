"""Reading a steps x tensors table a block of rows at a time, and what one pass over the
parameter tables reduces each step to. A million steps x 200 tensors is 800 MB a statistic:
nothing here ever holds one whole."""

from __future__ import annotations

import numpy as np

# A block of rows read at a time holds about this many values (8 MB as float64), whatever the
# width of the table: wide enough for numpy to be fast, small enough to bound memory.
_BLOCK_VALUES = 1 << 20


# Activity windows read at a time (each is a few KB of bits).
_WINDOWS_PER_READ = 256


def block_rows(width: int) -> int:
    """Rows per block for a table ``width`` values wide."""
    # At least 16 rows: a table of 100,000 tensors still reads in blocks of ~13 MB.
    return int(np.clip(_BLOCK_VALUES // max(int(width), 1), 16, 1 << 17))


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

    and per parameter, over the same pass (detectors/params_not_learning.py):

    grad_steps         steps on which it had a gradient
    grad_zero_steps    ... exactly 0
    norm_min, norm_max its smallest and largest measured weight norm (inf/-inf: never measured)
    """

    def __init__(self, n: int, n_params: int = 0):
        self.total_grad_norm = np.full(n, np.nan)
        self.grad_nonfinite = np.zeros(n, dtype=bool)
        self.grad_absent = np.ones(n, dtype=bool)
        self.param_nonfinite = np.zeros(n, dtype=bool)
        self.grad_steps = np.zeros(n_params, dtype=np.int64)
        self.grad_zero_steps = np.zeros(n_params, dtype=np.int64)
        self.norm_min = np.full(n_params, np.inf)
        self.norm_max = np.full(n_params, -np.inf)


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
