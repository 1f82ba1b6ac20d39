"""update_ratio: each weight's median sampled ||dw||/||w|| over the last half of the samples:
above 1e-1 too large, below 1e-6 (with a non-zero gradient) too small."""

import numpy as np

from tests.tracebuilder import TraceBuilder, findings

KIND = "update_ratio"
SAMPLES = range(0, 100, 10)


def run(ratio) -> TraceBuilder:
    """Weights of norm 1 (measured on every step), gradients of norm 1, sampled ratios."""
    b = TraceBuilder.mlp(layers=3, steps=100).loss(1.0).set("params/grad_norm", 1.0).set("params/param_norm", 1.0)
    return b.updates(SAMPLES, {"0.weight": 1e-3, "2.weight": 1e-3, "4.weight": 1e-3, **ratio})


def test_updates_too_large_from_step_50(tmp_path):
    run({"2.weight": [1e-3] * 5 + [0.5] * 5}).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 50, ["2.weight"])
    assert f.evidence["direction"] == "too_large" and f.evidence["weights_judged"] == 3
    assert f.evidence["window_steps"] == [50, 90]


def test_weights_that_barely_move(tmp_path):
    run({"0.weight": 1e-8}).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 0, ["0.weight"])
    assert f.evidence["direction"] == "too_small"


def test_usual_ratios_and_biases_are_quiet(tmp_path):
    run({"0.bias": 5.0, "4.bias": 1e-9}).write(tmp_path)  # biases are not judged
    assert findings(tmp_path, KIND) == []


def test_frozen_and_zero_initialised_weights_are_not_judged(tmp_path):
    b = run({"0.weight": 0.0, "2.weight": 50.0})
    b.set("params/grad_norm", np.nan, col="0.weight")  # frozen: no gradient
    b.set("params/param_norm", 0.0, col="2.weight")  # zero-initialised (LoRA B)
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_too_few_samples(tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=100).loss(1.0).set("params/grad_norm", 1.0).set("params/param_norm", 1.0)
    b.updates([0, 10], {"2.weight": 0.5}).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_update_ratios_recorded(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).total_grad_norm(1.0).write(tmp_path)  # an empty table
    assert findings(tmp_path, KIND) == []


def test_trace_without_the_update_table_is_not_checked(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).total_grad_norm(1.0).without("updates").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, [])
    assert f.evidence["lacking"] == ["updates/ratio"]
