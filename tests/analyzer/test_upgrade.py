"""Older traces: a trace that lacks every dataset added after the first traces (upgrade.ADDED)
reads as upgrade.py says, and is analyzed, the detectors that need one of them saying "not
checked" (a column filled in as "not measured" cannot be judged). (That each of those datasets is one today's
recorder writes: test_schema_agreement.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from tests.tracebuilder import TraceBuilder, findings
from torchautopsy.analyzer.detectors import DETECTORS
from torchautopsy.analyzer.trace import load, upgrade


def _old_trace(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=40).loss(1.0).total_grad_norm(1.0)
    b.activity_site("1", units=16)
    b.activity_window(0, 4).activity_window(5, 14)
    b.census(10, 3, grad_fn="AddmmBackward0")
    return b.without(*upgrade.ADDED).write(tmp_path)


def test_a_trace_lacking_every_added_dataset_reads_as_upgrade_says(tmp_path):
    _old_trace(tmp_path)
    rt = load(str(tmp_path)).ranks[0]
    assert not any(rt.lacks(name) for name in upgrade.ADDED)
    assert np.isnan(rt.columns["lr"]).all() and (rt.columns["optimizer_steps"] == -1).all()
    assert (rt.columns["live_tensors"] == -1).all() and np.isnan(rt.columns["forward_s"]).all()
    assert rt.steps[["lr", "optimizer_steps", "live_tensors"]].isna().all().all()  # users read NaN
    assert (rt.param_shards == 1).all()
    assert list(rt.census_groups["grad_fn"]) == [""]
    # Schema 1 watched every step of an activity window.
    assert [w[-1] for w in rt.activity_windows()] == [5, 10]
    kinds = {f.kind for f in findings(tmp_path) if f.summary.startswith(f"{f.kind} not checked")}
    assert kinds == {d.KIND for d in DETECTORS if any(upgrade.added(n) for n in d.REQUIRES)}, kinds
    assert {"slow_steps", "loss_scale_collapse", "input_data", "train_eval_mode"} <= kinds


def test_a_filled_column_is_read_only_like_every_column():
    col = upgrade.column("steps/lr", 3)
    with pytest.raises(ValueError):
        col[0] = 1.0

