"""dataloader_bottleneck: the median share of the step spent waiting in DataLoader.__next__
reaches 30% (after the first 5 steps)."""

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "dataloader_bottleneck"


def run(wait) -> TraceBuilder:
    b = TraceBuilder.mlp(layers=3, steps=100).loss(1.0)
    b.set("steps/between_steps_s", np.asarray(wait) + 0.002).set("steps/data_wait_s", wait)
    return b.set("steps/forward_s", 0.02).set("steps/backward_s", 0.04).set("steps/recorder_s", 0.001)


def test_training_waits_for_its_batches(tmp_path):
    run(np.where(np.arange(100) < 40, 0.002, 0.2)).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.where) == ("warning", [])
    assert f.step == 44  # the 10-step trailing median share (half the window waiting) stays above 30%
    assert f.evidence["data_wait_share"] > 0.7


def test_a_fed_model_is_quiet(tmp_path):
    run(np.full(100, 0.003)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_dataloader_used(tmp_path):
    run(np.full(100, np.nan)).write(tmp_path)  # data_wait_s NaN: no DataLoader
    assert findings(tmp_path, KIND) == []


def test_older_trace_without_data_wait(tmp_path):
    run(np.full(100, 0.2)).without("steps/data_wait_s").write(tmp_path)
    [f] = findings(tmp_path, KIND)  # (the column upgrade.py fills in reads "not measured": not judged)
    assert f.severity == "info" and "not checked" in f.summary and f.evidence["lacking"] == ["steps/data_wait_s"]
