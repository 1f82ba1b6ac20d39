"""vanishing_gradients: the first weights' gradient RMS orders of magnitude below the last
ones' over the last quarter of the run, dated where the trailing ratio fell under 1e-3."""

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "vanishing_gradients"


def run(steps=100) -> TraceBuilder:
    # Weights 0.weight [8, 8], 2.weight [8, 8], 4.weight [1, 8]: the first third is 0.weight.
    b = TraceBuilder.mlp(layers=3, steps=steps).loss(np.linspace(2.0, 1.0, steps))
    return b.total_grad_norm(0.5)


def test_first_layer_gradients_vanish_from_step_40(tmp_path):
    run().set("params/grad_norm", 1e-5, at=slice(40, None), col="0.weight").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    # Onset: the 5-step trailing median of the ratio is under 1e-3 from the third such step.
    assert (f.severity, f.step, f.where) == ("warning", 42, ["0.weight"])
    assert f.evidence["window_steps"] == [75, 99]
    assert f.evidence["early_to_late_rms_ratio"] < 1e-3


def test_every_weight_gradient_exactly_zero(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).total_grad_norm(0.0).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step) == ("warning", 75)
    assert f.where == ["0.weight", "2.weight", "4.weight"] and "no layer is learning" in f.summary


def test_a_100x_gap_between_layers_is_healthy(tmp_path):
    run().set("params/grad_norm", 5e-3, col="0.weight").write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_vanishing_only_early_in_the_run_is_not_judged(tmp_path):
    # Small at first (a slow start), recovered long before the judged last quarter.
    run().set("params/grad_norm", 1e-6, at=slice(0, 30), col="0.weight").write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_gradient_recorded_is_not_checked(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, []) and "not checked" in f.summary


def test_fewer_than_three_weights_cannot_be_judged(tmp_path):
    b = TraceBuilder.mlp(layers=2, steps=100).loss(1.0).total_grad_norm(1.0)
    b.set("params/grad_norm", 1e-9, col="0.weight").write(tmp_path)
    assert findings(tmp_path, KIND) == []
