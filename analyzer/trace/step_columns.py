"""The per-step table of a rank (``steps/*``), read a column at a time: its column names and
what the columns added after the first traces read as when absent."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from .rank import RankTrace


# Step columns added to schema 1 after its first traces, and what they read as when absent.
_OPTIONAL_STEP_COLUMNS = {
    **dict.fromkeys(("live_tensors", "live_tensor_bytes", "live_tensors_with_graph"), -1),
    **dict.fromkeys(("between_steps_s", "data_wait_s", "forward_s", "backward_s", "recorder_s"), np.nan),
    "gc_s": np.nan,  # time in garbage collection during the step
    "gc_gen2": -1,  # full (generation 2) collections during the step
    # The optimizer's schedule (added to schema 2 later): NaN / -1 where not recorded.
    "lr": np.nan,
    "loss_scale": np.nan,
    "optimizer_steps": -1,
    "nonfinite_consumer": -1,  # (added later: the module that made a -Inf a fault)
    "loss_given": -1,  # (added later: 1 if rec.step() was given a loss; -1: not said)
    "output_grad_nonfinite": -1,  # (added later: the gradient at the model's outputs held NaN/Inf)
}
STEP_COLUMNS = ("time_s", "loss", "rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes",
                "cuda_peak_bytes", "nonfinite_origin", "batch_nonfinite", *_OPTIONAL_STEP_COLUMNS)


class StepColumns:
    """The per-step table of a rank, read a column at a time (see RankTrace.steps)."""

    columns = STEP_COLUMNS

    def __init__(self, rt: RankTrace):
        self._rt = rt
        self.index = pd.Index(rt.step_index, name="step")

    def __getitem__(self, col):
        """A column as a Series by step; a list of columns as a DataFrame."""
        if isinstance(col, (list, tuple)):
            return self.frame(col)
        if col not in self.columns:
            raise KeyError(col)
        return pd.Series(self._rt._step_column(col), index=self.index, name=col, copy=False)

    def __contains__(self, col) -> bool:
        return col in self.columns

    def __len__(self) -> int:
        return len(self.index)

    def frame(self, cols=STEP_COLUMNS) -> pd.DataFrame:
        """Those columns as a DataFrame (all of them: 130 bytes a step)."""
        return pd.DataFrame({c: self[c] for c in cols}, index=self.index)
