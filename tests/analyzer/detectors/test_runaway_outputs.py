"""runaway_outputs: before the first NaN/Inf, the output layer's max |output| on watched
steps reached 10x its level over the watched steps before the last 20 steps."""

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "runaway_outputs"
WATCHED = range(0, 100, 10)


def failing_at(step: int, steps: int = 100) -> TraceBuilder:
    """mlp whose loss and gradients are NaN from ``step`` on; watched every 10 steps."""
    b = TraceBuilder.mlp(layers=3, steps=steps).loss(np.linspace(2.0, 1.0, steps)).total_grad_norm(1.0)
    b.loss(np.nan, at=slice(step, None)).set("params/grad_norm", np.nan, at=slice(step, None))
    b.set("params/grad_nonfinite", 8, at=slice(step, None))
    watched = [s for s in WATCHED if s < steps]
    return b.activations(watched).set("modules/output_absmax", 1.0, at=watched)


def test_output_layer_runs_away_before_the_nan(tmp_path):
    b = failing_at(95).set("modules/output_absmax", [30.0, 100.0], at=[80, 90], col="4")
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 80, ["4"])
    assert f.evidence["first_nonfinite_step"] == 95 and f.evidence["growth"] == 100.0


def test_outputs_growing_slowly_are_quiet(tmp_path):
    b = failing_at(95).set("modules/output_absmax", [1, 1.2, 1.4, 1.6, 1.8, 2, 2.2, 2.4, 2.6, 3.0], at=WATCHED, col="4")
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_a_hidden_layer_running_away_is_not_the_output_layer(tmp_path):
    failing_at(95).set("modules/output_absmax", 500.0, at=[80, 90], col="0").write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_large_outputs_without_a_failure_are_quiet(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).loss(1.0).total_grad_norm(1.0).activations(WATCHED)
    b.set("modules/output_absmax", 1.0, at=WATCHED).set("modules/output_absmax", 1e3, at=[80, 90], col="4")
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_outputs_not_measured(tmp_path):
    failing_at(95).set("modules/output_absmax", -1.0).write(tmp_path)  # -1: not measured
    assert findings(tmp_path, KIND) == []


def test_no_watched_steps(tmp_path):
    b = failing_at(95).without("activations")
    b.set("modules/output_absmax", 1e3, at=90, col="4").write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_a_step_without_loss_is_no_failure_when_gradients_were_not_recorded(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).loss(np.linspace(2.0, 1.0, 100)).activations(WATCHED)
    b.set("modules/output_absmax", 1.0, at=WATCHED).set("modules/output_absmax", 20.0, at=80, col="4")
    b.set("steps/loss", np.nan, at=95).set("steps/loss_given", 0, at=95).write(tmp_path)
    assert findings(tmp_path, "nonfinite") == []
    assert findings(tmp_path, KIND) == []  # warns "ran away ... before the first NaN/Inf at step 95"
