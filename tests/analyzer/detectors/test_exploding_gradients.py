"""exploding_gradients: the total gradient norm against its early healthy steps (sustained
growth: error, a lone jump: warning), and across depth from the first steps."""

import numpy as np
import pytest

from tests.tracebuilder import TraceBuilder, findings

KIND = "exploding_gradients"


def run(steps=100) -> TraceBuilder:
    return TraceBuilder.mlp(layers=3, steps=steps).loss(np.linspace(2.0, 1.0, steps)).total_grad_norm(1.0)


def test_sustained_growth_is_an_error_at_its_onset(tmp_path):
    # Total norm 1.0 for 60 steps, then the output layer's gradient at 1e4.
    run().set("params/grad_norm", 1e4, at=slice(60, None), col="4.weight").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where[0]) == ("error", 60, "4.weight")
    assert f.evidence["baseline_total_grad_norm"] == pytest.approx(1.0) and f.evidence["baseline_steps"] == [0, 9]
    assert f.evidence["ratio_at_step"] > 9000 and f.evidence["first_nonfinite_step"] is None


def test_growth_ending_in_overflow_is_dated_where_it_began(tmp_path):
    # A ramp of 3x a step from step 50, Inf from step 62: dated at its 30x crossing of the steps before.
    b = run()
    b.set("params/grad_norm", 3.0 ** np.arange(1, 13), at=slice(50, 62), col="2.weight")
    b.set("params/grad_norm", np.inf, at=slice(62, None), col="2.weight")
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.where[0]) == ("error", "2.weight")
    assert f.step == 53 and f.evidence["first_nonfinite_step"] == 62


def test_a_lone_jump_above_1000x_is_a_warning(tmp_path):
    run().set("params/grad_norm", 5e3, at=70, col="0.weight").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where[0]) == ("warning", 70, "0.weight")


def test_gradients_far_larger_in_the_first_layers_from_the_start(tmp_path):
    # Early weight's gradient RMS >= 100x the last layer's: exploding through depth, not in time.
    run().set("params/grad_norm", 1000.0, col="0.weight").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 0, ["0.weight"])
    assert f.evidence["early_to_late_rms_ratio"] >= 100


def test_activations_growing_through_depth_on_the_first_watched_step(tmp_path):
    b = TraceBuilder.mlp(layers=5, steps=30).loss(1.0).total_grad_norm(1.0)
    b.activations([0], mean={m: 0.0 for m in ("0", "2", "4", "6", "8")},
                  std={"0": 1.0, "2": 4.0, "4": 16.0, "6": 64.0, "8": 256.0})
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 0, ["0", "2", "4"])
    assert f.evidence["activation_growth"] == 256.0


def test_decaying_norms_and_a_spike_under_the_threshold_stay_quiet(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).loss(np.linspace(2.0, 1.0, 100))
    b.total_grad_norm(np.geomspace(10.0, 0.1, 100)).set("params/grad_norm", 300.0, at=70, col="0.weight")
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_zero_loss_steps_do_not_make_the_baseline(tmp_path):
    # The first steps' loss is exactly 0 with ~0 gradients: ordinary gradients after them are no explosion.
    b = run().set("steps/loss", 0.0, at=slice(0, 20)).total_grad_norm(1e-6, at=slice(0, 20))
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_gradient_recorded_is_not_checked(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).write(tmp_path)  # grad_norm NaN: no gradient
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, [])
    assert "not checked" in f.summary


def test_too_few_healthy_steps_for_a_baseline(tmp_path):
    TraceBuilder.mlp(layers=3, steps=5).loss(1.0).total_grad_norm(1.0).write(tmp_path)
    assert findings(tmp_path, KIND) == []
