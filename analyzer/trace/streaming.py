"""Reading a steps x tensors table a block of rows at a time, and what one pass over the
parameter tables reduces each step to. A million steps x 200 tensors is 800 MB a statistic:
nothing here ever holds one whole."""

from __future__ import annotations

import warnings

import numpy as np

from ..series import row_nanmedian

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

    and per step, over the weight tensors (weight_thirds; detectors/vanishing_gradients.py):

    early_to_late      the smallest gradient RMS of the first third over the median of the last
                       third's (NaN: fewer than 3 weight tensors)
    weight_grads       some weight tensor had a gradient

    (Each is made here rather than by its detector so that a million-step table is read once.)
    """

    def __init__(self, n: int, n_params: int = 0):
        self.early_to_late = np.full(n, np.nan)
        self.weight_grads = np.zeros(n, dtype=bool)
        self.total_grad_norm = np.full(n, np.nan)
        self.grad_nonfinite = np.zeros(n, dtype=bool)
        self.grad_absent = np.ones(n, dtype=bool)
        self.param_nonfinite = np.zeros(n, dtype=bool)
        self.grad_steps = np.zeros(n_params, dtype=np.int64)
        self.grad_zero_steps = np.zeros(n_params, dtype=np.int64)
        self.norm_min = np.full(n_params, np.inf)
        self.norm_max = np.full(n_params, -np.inf)


def grad_rms(g: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Gradient RMS (L2 norm / sqrt(numel)), NaN where not finite."""
    rms = np.asarray(g, dtype=np.float64) / np.sqrt(numel)
    rms[~np.isfinite(rms)] = np.nan
    return rms


def weight_indices(param_shapes) -> list[int]:
    """Indices of the weight tensors (2 or more dimensions: matrices, kernels, embeddings), in
    definition order (depth)."""
    return [j for j, shape in enumerate(param_shapes) if len(shape) >= 2]


def weight_thirds(param_shapes) -> tuple[list[int], slice, slice] | None:
    """The weight tensors (weight_indices) and the first and the last third of them; None for
    fewer than 3."""
    weights = weight_indices(param_shapes)
    if len(weights) < 3:
        return None
    third = max(1, len(weights) // 3)
    return weights, slice(0, third), slice(len(weights) - third, len(weights))


def early_to_late(block: np.ndarray, weights: list[int], numel: np.ndarray, early: slice,
                  late: slice) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a block of gradient norms: the smallest early gradient RMS over the median
    late one, and whether any weight had a gradient."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rms = grad_rms(block[:, weights], numel)
        return np.nanmin(rms[:, early], axis=1) / row_nanmedian(rms[:, late]), ~np.isnan(rms).all(axis=1)


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
