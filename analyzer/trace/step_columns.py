"""The per-step table of a rank (``steps/*``, its columns as torchautopsy/trace_schema.py lists
them), read a column at a time (the columns added after the first traces read as upgrade.py says
when a trace lacks them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from ... import trace_schema

if TYPE_CHECKING:
    from .rank import RankTrace


# Columns where -1 in the file means "not measured" (a CPU run's CUDA bytes, a step without a
# census): RankTrace.steps, the DataFrame users read, shows NaN there.
NOT_MEASURED_IS_MINUS_ONE = trace_schema.minus_one_not_measured("steps")
# Every column of steps/ but the step itself (the index), in the file's order.
STEP_COLUMNS = tuple(c.name for c in trace_schema.columns("steps") if c.name != "step")


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
