"""The loss as the detectors and reports read it: NaN in steps/loss means either "rec.step() was
not given the loss" or a NaN loss, and only one of them is a failure."""

from __future__ import annotations

import numpy as np

from .rank import RankTrace


def loss_series(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """The loss of every step (NaN where none was given) and where it was really non-finite.

    The trace holds NaN both for "rec.step() was not given the loss" and for a NaN loss;
    steps/loss_given tells them apart (1: given, 0: not). In older traces, without it, a NaN
    counts as a NaN loss once a finite loss has been seen and when that step's gradients or
    weights are non-finite too, or absent (a NaN loss makes every gradient NaN); a NaN with
    finite gradients is a step whose loss was not passed.
    """
    loss = rt.columns["loss"].to_numpy(dtype=np.float64)
    nan = np.isnan(loss)
    real_nan = np.zeros(len(loss), dtype=bool)
    if nan.any():
        given = rt.columns["loss_given"].to_numpy()
        d = rt.digest
        broken = d.grad_nonfinite | d.param_nonfinite | d.grad_absent
        guessed = nan & (np.cumsum(~nan) > 0) & broken
        real_nan = np.where(given == 1, nan, np.where(given == 0, False, guessed))
    return loss, np.isinf(loss) | real_nan
