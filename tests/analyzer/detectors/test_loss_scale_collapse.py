"""loss_scale_collapse: after its start-up, AMP's GradScaler skips 5+ steps in a row
(warning), or its scale falls below 1 (error)."""

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "loss_scale_collapse"


def amp(skipped, scale_at_start=65536.0, steps=100) -> TraceBuilder:
    """A GradScaler halving its scale on each skipped step (optimizer_steps 0), else stepping."""
    skip = np.zeros(steps, dtype=bool)
    skip[list(skipped)] = True
    scale = scale_at_start / 2.0 ** np.cumsum(skip)
    b = TraceBuilder.mlp(layers=3, steps=steps).loss(1.0).total_grad_norm(1.0)
    b.set("steps/loss_scale", scale).set("steps/optimizer_steps", np.where(skip, 0, 1))
    at = np.flatnonzero(skip)  # overflowed fp16 gradients, never applied
    return b.set("params/grad_norm", np.inf, at=at).set("params/grad_nonfinite", 3, at=at)


def test_many_skips_in_a_row_after_the_start_up(tmp_path):
    amp([0, 1, 2] + list(range(50, 56))).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 50, [])
    assert f.evidence["longest_skipped_run"] == 6 and f.evidence["skipped_in_startup"] == 3


def test_scale_below_one_is_an_error(tmp_path):
    amp([0, 1, 2] + list(range(50, 100))).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step) == ("error", 50)  # the run of skips that took it there
    assert f.evidence["scale_min"] < 1


def test_start_up_skips_and_occasional_overflows_are_healthy(tmp_path):
    amp([0, 1, 2, 3, 40, 70]).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_grad_scaler(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).total_grad_norm(1.0).write(tmp_path)  # loss_scale NaN
    assert findings(tmp_path, KIND) == []


def test_older_trace_without_the_schedule_columns(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).loss(1.0).total_grad_norm(1.0)
    b.without("steps/loss_scale", "steps/optimizer_steps", "steps/lr").write(tmp_path)
    [f] = findings(tmp_path, KIND)  # (the columns upgrade.py fills in read "not measured": not judged)
    assert f.severity == "info" and "not checked" in f.summary
    assert f.evidence["lacking"] == ["steps/loss_scale", "steps/optimizer_steps"]
