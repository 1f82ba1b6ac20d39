"""loss_divergence: the 20-step median loss rises to 2x its best and stays up (warning), ends
100x up (error), or blows up to NaN/Inf while up (error); a recovered spike is quiet."""

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "loss_divergence"


def run(loss, steps=100) -> TraceBuilder:
    return TraceBuilder.mlp(layers=3, steps=steps).loss(loss).total_grad_norm(1.0)


def decay(n, start=2.0, end=0.5):
    return np.geomspace(start, end, n)


def test_loss_rises_and_stays_up(tmp_path):
    run(np.concatenate([decay(60), np.full(40, 1.5)])).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 60, [])
    assert f.evidence["first_nonfinite_loss_step"] is None
    assert f.evidence["best_smoothed_loss"] < 0.7 and f.evidence["loss_at_step"] == 1.5


def test_loss_ending_far_worse_than_at_the_start_is_an_error(tmp_path):
    run(np.concatenate([decay(50, 1.0, 0.01), np.full(50, 5.0)])).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    # Its 20-step median ends 5.0: over 100x its best (~0.02), and above where it started.
    assert (f.severity, f.step) == ("error", 50)
    assert f.evidence["final_smoothed_loss"] >= 100 * f.evidence["best_smoothed_loss"]


def test_loss_climbing_then_nan_is_an_error(tmp_path):
    loss = np.concatenate([np.full(50, 1.0), np.geomspace(2.0, 200.0, 20), np.full(30, np.nan)])
    b = run(loss).set("params/grad_norm", np.nan, at=slice(70, None))
    b.set("params/grad_nonfinite", 3, at=slice(70, None))
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step) == ("error", 50)
    assert f.evidence["first_nonfinite_loss_step"] == 70 and f.evidence["last_finite_loss_step"] == 69


def test_a_spike_the_run_recovers_from_is_quiet(tmp_path):
    loss = decay(100).copy()
    loss[50:60] = 5.0
    run(loss).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_noisy_decaying_loss_is_quiet(tmp_path):
    rng = np.random.default_rng(0)
    run(decay(300) * rng.chisquare(1, 300), steps=300).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_a_sudden_nan_from_normal_values_is_left_to_nonfinite(tmp_path):
    b = run(np.concatenate([decay(60), np.full(40, np.nan)]))
    b.set("params/grad_nonfinite", 1, at=slice(60, None)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_loss_passed_is_not_checked(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).total_grad_norm(1.0).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, []) and "not checked" in f.summary


def test_run_shorter_than_the_window(tmp_path):
    run(np.concatenate([np.full(10, 1.0), np.full(10, 10.0)]), steps=20).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_a_rise_under_twice_the_best_is_quiet(tmp_path):
    run(np.concatenate([decay(60), np.full(40, 1.0)])).write(tmp_path)  # best ~0.6: 1.6x
    assert findings(tmp_path, KIND) == []


def test_a_step_without_loss_is_not_a_blow_up_when_gradients_were_not_recorded(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).loss(np.concatenate([decay(60), np.full(40, 1.5)]))
    b.set("steps/loss", np.nan, at=90).set("steps/loss_given", 0, at=90).write(tmp_path)
    assert findings(tmp_path, "nonfinite") == []
    (f,) = findings(tmp_path, KIND)
    # As without step 90's gap: a warning, "stayed up"; it says error, "went NaN at step 90".
    assert (f.severity, f.step, f.evidence["first_nonfinite_loss_step"]) == ("warning", 60, None)


def test_a_jump_inside_the_first_window_is_dated_where_it_happened(tmp_path):
    """Issue 37 (8): a loss that jumped 1,000x at step 15, inside the first 20-step window, was
    dated at step 19 (the window's end), 4 steps after the jump."""
    loss = np.concatenate([np.linspace(2.0, 1.8, 15), np.full(45, 2000.0)])
    TraceBuilder.mlp(steps=60).loss(loss).write(tmp_path)
    (f,) = findings(tmp_path, "loss_divergence")
    assert f.step == 15 and f.severity == "error"
