"""loss_zero: the loss exactly 0.0 on half or more of the first 20 steps, or of the steps
before it went non-finite (warning); reached late in a run that never fails: info."""

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "loss_zero"


def run(loss, steps=100) -> TraceBuilder:
    return TraceBuilder.mlp(layers=3, steps=steps).loss(loss).total_grad_norm(1.0)


def test_zero_loss_on_most_of_the_first_steps(tmp_path):
    loss = np.full(100, 0.7)
    loss[3:17] = 0.0  # 14 of the first 20 steps: 70%
    run(loss).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 3, [])
    assert f.evidence["zero_share_first_steps"] == 0.7 and f.evidence["zero_loss_steps"] == 14


def test_zero_loss_before_the_loss_went_nan(tmp_path):
    loss = np.concatenate([np.full(20, 0.7), np.zeros(40), np.full(40, np.nan)])
    b = run(loss).set("params/grad_nonfinite", 1, at=slice(60, None))
    b.set("params/grad_norm", np.nan, at=slice(60, None))
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step) == ("warning", 20)
    assert f.evidence["first_nonfinite_loss_step"] == 60 and f.evidence["zero_share_before_failure"] == 40 / 60


def test_loss_reaching_zero_late_in_a_healthy_run_is_info(tmp_path):
    loss = np.concatenate([np.geomspace(1.0, 1e-6, 80), np.zeros(20)])
    run(loss).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step) == ("info", 80)


def test_zero_on_under_half_of_the_first_steps_is_only_info(tmp_path):
    loss = np.full(100, 0.7)
    loss[:9] = 0.0  # 45%
    run(loss).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step) == ("info", 0)


def test_tiny_but_nonzero_losses_are_quiet(tmp_path):
    run(np.full(100, 1e-12)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_loss_passed(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).total_grad_norm(1.0).write(tmp_path)  # NaN, loss_given 0
    assert findings(tmp_path, KIND) == []


NOT_GIVEN_BUG = ("trace.losses.loss_series ignores steps/loss_given: a step whose loss was not passed "
                 "(NaN, loss_given 0) in a trace without gradients counts as a NaN loss")


def test_a_step_without_loss_is_no_failure_when_gradients_were_not_recorded(tmp_path):
    # Zero from step 20 on (late, no failure): info. Step 60 got no loss (rec.step() without it),
    # and no gradient was recorded on any step (zero_grad() before rec.step()).
    loss = np.concatenate([np.full(20, 0.7), np.zeros(80)])
    b = TraceBuilder.mlp(layers=3, steps=100).loss(loss)
    b.set("steps/loss", np.nan, at=60).set("steps/loss_given", 0, at=60).write(tmp_path)
    assert findings(tmp_path, "nonfinite") == []  # nonfinite reads loss_given: no NaN there
    (f,) = findings(tmp_path, KIND)
    assert f.evidence["first_nonfinite_loss_step"] is None  # says 60 ("went non-finite at step 60")
    assert f.severity == "info"  # a warning, on the zero share "before the failure"
