"""RankTrace's readers of how the job set its training up: which parameters required gradients
and which ones each optimizer steps (recorder/schedule.py). What a parameter that never learns
is told by (detectors/not_learning.py). Absent from older traces: read as not known."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pandas as pd


class TrainingSetup:
    """Mixed into RankTrace."""

    @cached_property
    def param_requires_grad(self) -> np.ndarray:
        """Per parameter: 1 if it required gradients when the Recorder started, 0 if frozen, -1
        not known (older traces, a damaged column)."""
        n = len(self.param_names)
        if not self._has("params/requires_grad"):
            return np.full(n, -1, dtype=np.int64)
        values = self._read("params/requires_grad", n, ndim=1)
        if values.shape != (n,):
            return np.full(n, -1, dtype=np.int64)
        return np.where(np.isin(values, (0, 1)), values, -1).astype(np.int64)

    @cached_property
    def optimizer_params(self) -> pd.DataFrame:
        """The parameters each of the model's optimizers steps, as last seen: optimizer, param
        (index), requires_grad (then), step (when seen). Empty if never recorded (older traces,
        no optimizer). Rows naming no parameter of this trace are dropped (a damaged file)."""
        t = pd.DataFrame(self._table("optimizer_params", ("step", "optimizer", "param", "requires_grad"), ndim=1))
        if not len(t):
            return t
        t = t[(t["param"] >= 0) & (t["param"] < len(self.param_names)) & np.isfinite(t["step"].astype(float))]
        t = t.astype({"step": np.int64, "optimizer": np.int64, "param": np.int64, "requires_grad": np.int64})
        # An optimizer's membership is its latest rows (a changed group rewrites them all).
        latest = t.groupby("optimizer")["step"].transform("max")
        return t[t["step"] == latest].reset_index(drop=True)
