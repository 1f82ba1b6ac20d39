"""series.row_nanmedian is np.nanmedian(x, axis=1) to the bit (NaN, ±Inf, all-NaN rows, no
columns), only faster: the detectors' per-step medians at 1M steps use it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from torchautopsy.analyzer.series import row_nanmedian, trailing_median


@pytest.mark.parametrize("shape", [(200, 1), (200, 2), (200, 7), (500, 67), (3, 0)])
@pytest.mark.parametrize("nan_share", [0.0, 0.1, 0.6, 1.0])
def test_row_nanmedian_is_numpys_nanmedian(shape, nan_share):
    rng = np.random.default_rng(hash((shape, nan_share)) % 2**32)
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, size=shape)
    x[rng.random(shape) < nan_share] = np.nan
    if shape[1] > 1:
        x[1, 0], x[2, :] = np.inf, -np.inf
        x[3, :] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = np.nanmedian(x, axis=1)
    assert np.array_equal(row_nanmedian(x), want, equal_nan=True)


def test_trailing_median_ignores_nan_and_counts_inf_as_large():
    x = np.array([1.0, np.nan, 3.0, np.inf, 2.0, np.nan, np.nan, np.nan])
    assert np.array_equal(trailing_median(x, 3), [1.0, 1.0, 2.0, np.inf, 3.0, np.inf, 2.0, np.nan], equal_nan=True)
