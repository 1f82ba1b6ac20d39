"""Small vectorised helpers over per-step series."""

from __future__ import annotations

import warnings

import numpy as np


def trailing_median(x: np.ndarray, w: int) -> np.ndarray:
    """Median of x[i-w+1 .. i], NaN ignored, Inf counted as large (vectorised)."""
    padded = np.concatenate([np.full(w - 1, np.nan), x])
    windows = np.lib.stride_tricks.sliding_window_view(padded, w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows give NaN, as wanted
        return np.nanmedian(windows, axis=1)
