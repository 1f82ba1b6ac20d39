"""load(run).ranks[r].steps is a pandas DataFrame indexed by step, with NaN where a value was not
measured (never the file's -1), used as people use DataFrames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from tests.tracebuilder import TraceBuilder
from torchautopsy import load


def test_steps_is_a_dataframe_by_step_with_nan_for_not_measured(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=30, first_step=100).loss(np.linspace(2.0, 1.0, 30)).total_grad_norm(1.0)
    b.set("steps/rss_bytes", 5_000_000).set("steps/cuda_allocated_bytes", -1).set("steps/live_tensors", -1)
    b.set("steps/live_tensors", 42, at=[110]).set("steps/optimizer_steps", 1)
    b.write(tmp_path)
    steps = load(str(tmp_path)).ranks[0].steps
    assert isinstance(steps, pd.DataFrame) and steps.index.name == "step"
    assert steps.index[0] == 100 and len(steps) == 30
    assert steps.loc[110, "live_tensors"] == 42 and steps["live_tensors"].notna().sum() == 1
    assert steps["cuda_allocated_bytes"].isna().all()  # a CPU run: not measured, not -1
    assert not (steps.select_dtypes("number") == -1)[["rss_bytes", "live_tensors", "optimizer_steps"]].any().any()
    # As people use DataFrames: rolling means, describe, a query by step.
    assert steps["loss"].rolling(5).mean().iloc[-1] < steps["loss"].iloc[0]
    assert steps.loc[105:109, "loss"].is_monotonic_decreasing
    assert steps.describe().loc["count", "rss_bytes"] == 30


def test_the_per_module_frames_name_the_root_module():
    """named_modules() calls the root '' (and so do findings' `where`); the per-module frames a
    reader opens label its column '(model)', and the other modules as named_modules() does."""
    rt = load(str(Path(__file__).parents[2] / "sample_traces" / "nan_birth")).ranks[0]
    assert rt.module_names[0] == "" and rt.module_labels[0] == "(model)"
    out = rt.module_stat()
    assert list(out.columns) == ["(model)"] + rt.module_names[1:]
    assert out.loc[0, "(model)"] > 0  # step 0 is watched: the model's output measured
    # Rows only for the watched steps (issue 36: unwatched steps were rows of -1), every one measured.
    assert list(out.index) == [int(s) for s in rt.module_rows().index if rt.module_rows().loc[s].max() != -1]
    assert 0 < len(out) < rt.n_steps and (out.loc[:, "(model)"] != -1).all()
    acts = rt.activation_stat("mean")
    assert list(acts.columns) == list(out.columns)
