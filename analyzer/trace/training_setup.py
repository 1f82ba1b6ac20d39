"""RankTrace's readers of how the job set its training up: which parameters required gradients
and which ones each optimizer steps (recorder/optimizer/schedule.py). What a parameter that never learns
is told by (detectors/params_not_learning.py). Absent from older traces: read as not known."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pandas as pd

from .format import parse_json


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

    @cached_property
    def loss_function_ops(self) -> list[str] | None:
        """The loss function's autograd ops (recorder/loss_graph.loss_ops: NllLossBackward0, ...) at
        the first step whose loss reached the model's outputs; [] when the model computed its own
        loss; None if not recorded (older traces, no loss tensor given)."""
        t = self._texts_table("loss_function", ("step", "ops"), ("ops",))
        if not len(t):
            return None
        ops = parse_json(t["ops"].iloc[0])
        return [str(o)[:100] for o in ops[:64]] if isinstance(ops, list) and all(isinstance(o, str) for o in ops) \
            else None

    def output_shapes(self, module: int = 0) -> list[tuple[int, ...]]:
        """The shapes of a module's first floating-point outputs as first seen on a watched step
        (the root's: module 0), in their order; [] if not recorded."""
        t = self.module_outputs
        if not len(t):
            return []
        shapes = []
        for text in t[t["module_index"] == module]["shape"]:
            shape = parse_json(text)
            if isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 2**62 for d in shape):
                shapes.append(tuple(shape))
        return shapes
