"""The per-step table of a rank (``steps/*``), read a column at a time (the columns added after
the first traces read as upgrade.py says when a trace lacks them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from . import upgrade

if TYPE_CHECKING:
    from .rank import RankTrace


# Columns where -1 in the file means "not measured" (a CPU run's CUDA bytes, a step without a
# census): RankTrace.steps, the DataFrame users read, shows NaN there.
NOT_MEASURED_IS_MINUS_ONE = ("rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes", "cuda_peak_bytes",
                             "live_tensors", "live_tensor_bytes", "live_tensors_with_graph", "gc_gen2",
                             "optimizer_steps", "loss_given", "output_grad_nonfinite", "grads_kept",
                             "train_mode", "nograd_train_forwards", "input_constant_features")
STEP_COLUMNS = ("time_s", "loss", "rss_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes",
                "cuda_peak_bytes", "nonfinite_origin", "batch_nonfinite", *upgrade.step_columns())


class StepColumns:
    """The per-step table of a rank, read a column at a time (RankTrace.columns; RankTrace.steps is the DataFrame)."""

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
