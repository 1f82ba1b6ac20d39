"""nonfinite: the first NaN/Inf step, and where it was born (batch, forward, loss, backward,
optimizer), from steps/nonfinite_origin, the gradients' NaN/Inf counts and the weight norms."""

import math

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "nonfinite"


def healthy(steps=60) -> TraceBuilder:
    b = TraceBuilder.mlp(layers=3, steps=steps)
    b.loss(np.linspace(2.0, 1.0, steps)).total_grad_norm(1.0)
    return b.set("params/param_norm", 3.0, at=slice(0, None, 10))  # measured on watched steps


def nan_from(b: TraceBuilder, step: int, loss=True) -> TraceBuilder:
    """Every gradient NaN from ``step`` on (and the loss, unless loss=False)."""
    if loss:
        b.loss(np.nan, at=slice(step, None))
    return b.set("params/grad_norm", np.nan, at=slice(step, None)).set("params/grad_nonfinite", 64,
                                                                          at=slice(step, None))


def test_nan_loss_born_in_a_module_forward(tmp_path):
    b = nan_from(healthy(), 37)
    b.set("steps/nonfinite_origin", b.module_index("2"), at=37)
    b.set("modules/output_absmax", 1.5, at=37, col=["", "0", "1"]).set("modules/output_absmax", np.nan, at=37,
                                                                      col=["2", "3", "4"])
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("error", 37, ["2"])
    assert f.evidence["stage"] == "forward" and "2 (Linear)" in f.summary
    assert math.isnan(f.evidence["origin_module_output_absmax"])
    assert f.evidence["modules_with_nonfinite_output"] == 3
    assert f.evidence["nonfinite_steps_after"] == 23 and f.evidence["loss_before"] == b.cols["steps/loss"][36]


def test_minus_inf_made_upstream_and_turned_into_nan_downstream(tmp_path):
    b = nan_from(healthy(), 20)
    b.set("steps/nonfinite_origin", b.module_index("0"), at=20)
    b.set("steps/nonfinite_consumer", b.module_index("2"), at=20)
    b.set("modules/output_absmax", np.inf, at=20, col=["0", "1"]).set("modules/output_absmax", np.nan, at=20,
                                                                    col=["", "2", "3", "4"])
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where, f.evidence["stage"]) == (20, ["0"], "forward")
    assert f.evidence["chain"] == {"producer": "0", "consumer": "2", "step": 20}


def test_nan_loss_with_every_module_output_finite_blames_the_loss_function(tmp_path):
    b = nan_from(healthy(), 37).set("modules/output_absmax", 2.0, at=37)  # a watched step, all finite
    b.row("loss_checks", step=37, outputs_nonfinite=0, ops='["NegBackward0", "LogBackward0", "SoftmaxBackward0"]')
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where, f.evidence["stage"]) == (37, [], "loss")
    assert f.evidence["loss_ops"] == ["NegBackward0", "LogBackward0", "SoftmaxBackward0"]
    assert f.evidence["outputs_nonfinite_on_step"] is False


def test_nonfinite_gradient_born_in_the_backward_pass(tmp_path):
    # Forward and loss finite (outputs checked on this watched step), two weights' gradients NaN.
    b = healthy()
    b.set("modules/output_absmax", 2.0, at=25).set("steps/output_grad_nonfinite", 0, at=25)
    b.set("params/grad_norm", np.nan, at=25, col=["0.weight", "2.weight"])
    b.set("params/grad_nonfinite", 7, at=25, col=["0.weight", "2.weight"])
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    # Backward reaches the last-defined parameters first: 2.weight is named, not 0.weight.
    assert (f.severity, f.step, f.where, f.evidence["stage"]) == ("error", 25, ["2.weight"], "backward")
    assert f.evidence["params_with_nonfinite_grad"] == {"0.weight": 7, "2.weight": 7}


def test_nonfinite_gradient_from_the_loss_functions_backward(tmp_path):
    b = nan_from(healthy(), 30, loss=False)
    b.set("modules/output_absmax", 2.0, at=30).set("steps/output_grad_nonfinite", 1, at=30)
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where, f.evidence["stage"]) == (30, [], "loss_backward")


def test_weights_nonfinite_after_the_update_blame_the_optimizer(tmp_path):
    b = healthy().set("params/param_norm", np.inf, at=slice(10, None), col="4.weight")
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where, f.evidence["stage"]) == (10, ["4.weight"], "optimizer")


def test_nonfinite_input_batch(tmp_path):
    b = nan_from(healthy(), 5).set("steps/batch_nonfinite", 1, at=5)
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where, f.evidence["stage"]) == (5, [], "batch")


def test_nan_loss_on_a_step_whose_modules_were_not_checked_says_so(tmp_path):
    # Modules not watched (-1) and the replay found no origin: not blamed on the loss function.
    nan_from(healthy(), 37).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where, f.evidence["stage"]) == ("error", 37, [], "unchecked")


def test_healthy_run_and_missing_losses_are_quiet(tmp_path):
    # NaN is also "no loss was passed to rec.step()": with loss_given 0 and finite gradients it is no fault.
    b = healthy().set("steps/loss", np.nan, at=slice(10, 20)).set("steps/loss_given", 0, at=slice(10, 20))
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_steps_the_grad_scaler_skipped_are_not_failures(tmp_path):
    # AMP: overflowed fp16 gradients on steps the GradScaler skipped (never applied).
    b = healthy().set("steps/loss_scale", 1024.0).set("steps/optimizer_steps", 1)
    b.set("steps/optimizer_steps", 0, at=[3, 40]).set("params/grad_norm", np.inf, at=[3, 40])
    b.set("params/grad_nonfinite", 5, at=[3, 40])
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_loss_and_no_gradients_recorded(tmp_path):
    TraceBuilder.mlp(steps=60).write(tmp_path)  # every column "not measured"
    assert findings(tmp_path, KIND) == []


def test_older_trace_without_loss_given_and_without_gradients(tmp_path):
    # Traces from before loss_given: a NaN loss with no gradient is a loss not passed.
    TraceBuilder.mlp(steps=60).without("steps/loss_given").write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_trace_without_origins_is_not_checked(tmp_path):
    nan_from(healthy(), 37).without("steps/nonfinite_origin").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, [])
    assert f.evidence["lacking"] == ["steps/nonfinite_origin"]
