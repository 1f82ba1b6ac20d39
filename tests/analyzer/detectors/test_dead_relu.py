"""dead_relu: the share of a ReLU site's units never positive in its latest judged activity
window: >= 50% a warning, >= 90% an error; dated when the share crossed and stayed."""

import numpy as np
import pytest

from torchautopsy.analyzer.trace import site_tables
from tests.tracebuilder import TraceBuilder, findings

KIND = "dead_relu"
# The recorder's windows: 5, 10, 20 and 40 steps, then the rest (the partial last window).
WINDOWS = [(0, 4), (5, 14), (15, 34), (35, 74), (75, 99)]


def run(**alive_by_window) -> TraceBuilder:
    """mlp with ReLU sites "1" and "3" (16 units each); alive_by_window: {"w3": {"3": 6}, ...}."""
    b = TraceBuilder.mlp(layers=3, steps=100).loss(1.0).total_grad_norm(1.0)
    b.activity_site("1", units=16).activity_site("3", units=16)
    for k, (start, end) in enumerate(WINDOWS):
        b.activity_window(start, end, alive=alive_by_window.get(f"w{k}"))
    return b


def test_layer_dead_from_the_start_is_an_error(tmp_path):
    run(**{f"w{k}": {"1": 0} for k in range(5)}).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("error", 0, ["1"])
    assert f.evidence["dead_share"] == 1.0 and f.evidence["dead_since_start"] == 16
    assert f.evidence["window_steps"] == [75, 99] and f.evidence["died_during_training"] == 0


def test_units_dying_during_training_are_a_warning(tmp_path):
    run(w4={"3": 6}).write(tmp_path)  # 10 of 16 dead in the last window
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 75, ["3"])
    assert f.evidence["dead_units"] == 10 and f.evidence["died_during_training"] == 10
    assert f.evidence["first_death_step"] == 75 and f.evidence["first_death_between"] == [35, 75]


def test_a_few_dead_units_are_healthy(tmp_path):
    run(**{f"w{k}": {"1": 13, "3": 14} for k in range(5)}).write(tmp_path)  # 19% and 12% dead
    assert findings(tmp_path, KIND) == []


def test_units_that_came_back_to_life_are_not_dead(tmp_path):
    run(w1={"1": 0}, w2={"1": 0}, w3={"1": 0}).write(tmp_path)  # alive again in the last window
    assert findings(tmp_path, KIND) == []


def test_a_site_seen_on_too_few_watched_steps_is_not_judged(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).activity_site("1", units=16)
    b.activity_window(0, 99, alive={"1": 0}, watched=10, seen={"1": 2})  # ran on 2 of 10 watched steps
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_narrow_layers_are_not_judged(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).activity_site("1", units=4)
    b.activity_window(0, 99, alive={"1": 0}).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_trace_without_activity_tracking_is_not_checked(tmp_path):
    # Recorded before activity tracking: no activity tables, no activity_window option.
    TraceBuilder.mlp(layers=3, steps=100, config={}).without("activity", "activity_sites").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, []) and "not checked" in f.summary


def test_model_without_activation_sites_is_quiet(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).write(tmp_path)  # tracking on, no ReLU call seen
    assert findings(tmp_path, KIND) == []


@pytest.mark.parametrize("units", [13, 8])  # (8: every site fills whole bytes, counted packed)
def test_windows_read_a_block_at_a_time_judge_as_one_at_a_time(tmp_path, monkeypatch, units):
    # The scan takes a block of windows at once; its state (last alive window per unit, last
    # judged window and crossing per site) must not depend on where the blocks split. Deaths,
    # a recovery, windows judging nothing (no watched step, a site seen too rarely), 24 windows.
    rng = np.random.default_rng(0)
    b = TraceBuilder.mlp(layers=4, steps=1200).loss(1.0).total_grad_norm(1.0)
    b.activity_site("1", units=16).activity_site("3", units=units).activity_site("5", units=16)
    for k in range(24):
        alive = {"1": rng.random(16) < (0.9 if k < 8 else 0.2), "3": rng.random(units) < (0.1 if 6 < k < 12 else 0.9),
                 "5": rng.random(16) < 0.3}
        b.activity_window(50 * k, 50 * k + 49, alive=alive, watched=0 if k % 7 == 3 else 5,
                          seen={"5": 1} if k % 5 == 2 else None)
    b.write(tmp_path)
    whole = [f.to_dict() for f in findings(tmp_path, KIND)]
    assert len(whole) >= 2
    for per_read in (1, 2, 5):
        monkeypatch.setattr(site_tables, "_WINDOWS_PER_READ", per_read)
        assert [f.to_dict() for f in findings(tmp_path, KIND)] == whole
