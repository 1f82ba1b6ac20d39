"""saturation: half or more of a tanh/sigmoid site's outputs within 1% of its bounds in the
latest activity window, dated from the first window after which it stayed so."""

import pytest

from tests.tracebuilder import TraceBuilder, findings

KIND = "saturation"
WINDOWS = [(0, 4), (5, 14), (15, 34), (35, 74), (75, 99)]


def run(shares) -> TraceBuilder:
    b = TraceBuilder.mlp(layers=3, steps=100, act="Tanh").loss(1.0).total_grad_norm(1.0)
    b.activity_site("1", function="tanh", units=0).activity_site("3", function="relu", units=8)
    for (start, end), share in zip(WINDOWS, shares):
        b.activity_window(start, end, saturated={"1": share})
    return b


def test_tanh_saturated_from_step_15(tmp_path):
    run([0.1, 0.3, 0.6, 0.8, 0.9]).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 15, ["1"])
    assert f.evidence["saturated_share"] == pytest.approx(0.9) and f.evidence["window_steps"] == [75, 99]


def test_recovered_or_mild_saturation_is_quiet(tmp_path):
    run([0.9, 0.9, 0.6, 0.2, 0.1]).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_tanh_or_sigmoid_sites(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).activity_site("1").activity_window(0, 99).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_trace_without_activity_tables_is_not_checked(tmp_path):
    run([0.9] * 5).without("activity", "activity_sites").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, [])
    assert f.evidence["lacking"] == ["activity/saturated_frac"]


def test_several_saturated_layers_are_one_finding_the_first_named_first(tmp_path):
    """One cause saturates every tanh layer: one warning listing them, dated and named by the
    first to saturate (issue 36: a tanh MLP got 16 warnings)."""
    b = TraceBuilder.mlp(layers=5, steps=100, act="Tanh").loss(1.0).total_grad_norm(1.0)
    for m in ("1", "3", "5", "7"):
        b.activity_site(m, function="tanh", units=0)
    shares = {"1": [0.1, 0.2, 0.3, 0.7, 0.8], "3": [0.1, 0.6, 0.7, 0.8, 0.9], "5": [0.1, 0.2, 0.6, 0.7, 0.95],
              "7": [0.0, 0.1, 0.1, 0.1, 0.1]}
    for k, (start, end) in enumerate(WINDOWS):
        b.activity_window(start, end, saturated={m: v[k] for m, v in shares.items()})
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where) == (5, ["3", "5", "1"])
    assert [x["module"] for x in f.evidence["layers"]] == ["3", "5", "1"]
    assert f.evidence["saturated_share"] == pytest.approx(0.9) and "3 layers" in f.summary
