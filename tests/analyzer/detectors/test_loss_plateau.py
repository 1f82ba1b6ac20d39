"""loss_plateau (info): over the last half of the run, the median loss of its last fifth
within 5% of its first fifth's, while gradients still flow."""

import numpy as np
import pytest

from tests.tracebuilder import TraceBuilder, findings

KIND = "loss_plateau"


def run(loss, steps=200) -> TraceBuilder:
    return TraceBuilder.mlp(layers=3, steps=steps).loss(loss).total_grad_norm(0.5)


def test_loss_flat_over_the_second_half(tmp_path):
    rng = np.random.default_rng(0)
    loss = np.concatenate([np.linspace(2.0, 1.0, 80), np.ones(120)]) + 0.01 * rng.standard_normal(200)
    run(loss).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    # Dated where the 20-step median came within 5% of the plateau (6 steps into it: its median is
    # then the decay's last values, ~1.04).
    assert (f.severity, f.step, f.where) == ("info", 85, [])
    assert abs(f.evidence["loss_level"] - 1.0) < 0.01 and f.evidence["judged_steps"] == [100, 199]
    assert f.evidence["median_total_grad_norm"] == pytest.approx(0.5)


def test_loss_still_improving_is_quiet(tmp_path):
    run(np.linspace(2.0, 1.0, 200)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_gradient_at_all_is_left_to_vanishing_gradients(tmp_path):
    run(np.ones(200)).total_grad_norm(0.0).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_loss_passed_is_not_checked(tmp_path):
    TraceBuilder.mlp(layers=3, steps=200).total_grad_norm(0.5).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, []) and "not checked" in f.summary


def test_run_too_short_for_a_plateau(tmp_path):
    run(np.ones(80), steps=80).write(tmp_path)  # judged stretch: 40 steps, under 50
    assert findings(tmp_path, KIND) == []
