"""Queries over the gradient norms that detectors and reports share: gradient RMS by weight
tensor, and its median per tensor over a span of steps (as vanishing_gradients judges it and its
figure draws it)."""

from __future__ import annotations

import warnings

import numpy as np

from ..series import evenly_spaced, sample_rows
from .rank import RankTrace
from .streaming import grad_rms, weight_indices  # (grad_rms: detectors import it from here)

# Rows read at most for a per-tensor median over a span: an evenly spaced sample of a long span
# gives the same median within noise, in bounded memory.
MAX_SPAN_ROWS = 20_000


def weight_tensors(rt: RankTrace) -> list[int]:
    """Indices of the weight tensors, in definition order (streaming.weight_indices)."""
    return weight_indices(rt.param_shapes)


def median_grad_rms(rt: RankTrace, rows: np.ndarray, tensors: list[int]) -> np.ndarray:
    """The median gradient RMS of each of ``tensors`` over the steps at row indices ``rows``
    (an evenly spaced sample of them when long), NaN for a tensor never measured there."""
    sample = evenly_spaced(np.asarray(rows), sample_rows(len(tensors), MAX_SPAN_ROWS))
    g = rt.param_stat("grad_norm", rows=sample).to_numpy(dtype=np.float64)[:, tensors]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (all-NaN columns)
        return np.nanmedian(grad_rms(g, rt.param_numel[tensors].astype(np.float64)), axis=0)
