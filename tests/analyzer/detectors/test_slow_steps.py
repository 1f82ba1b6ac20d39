"""slow_steps (info): steps over 3x the median step and 50 ms slower, with the phase that grew;
the first step and the recorder's own probes are expected, not reported."""

from tests.tracebuilder import TraceBuilder, findings

KIND = "slow_steps"


def run(forward=0.05) -> TraceBuilder:
    b = TraceBuilder.mlp(layers=3, steps=100).loss(1.0)
    b.set("steps/between_steps_s", 0.01).set("steps/data_wait_s", 0.005).set("steps/forward_s", forward)
    return b.set("steps/backward_s", 0.1).set("steps/recorder_s", 0.001)


def test_a_step_with_a_slow_forward(tmp_path):
    run().set("steps/forward_s", 1.0, at=60).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", 60, [])
    (slow,) = f.evidence["slowest"]
    assert slow["slowest_phase"] == "forward" and not slow["expected"]


def test_slow_first_step_and_recorder_probes_are_expected(tmp_path):
    b = run().set("steps/forward_s", 1.0, at=0).set("steps/recorder_s", 1.0, at=50)
    b.write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_millisecond_jitter_is_quiet(tmp_path):
    # Median step 13 ms; step 60 takes 62 ms: 4.8x the median, but only 49 ms slower.
    run(forward=0.001).set("steps/backward_s", 0.001).set("steps/forward_s", 0.05, at=60).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_step_times_not_recorded(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).write(tmp_path)  # phases NaN
    assert findings(tmp_path, KIND) == []


def test_older_trace_without_step_times(tmp_path):
    # Step-time columns came after the first traces: absent, they read as NaN (not timed).
    run().set("steps/forward_s", 1.0, at=60).without("steps/between_steps_s", "steps/data_wait_s", "steps/forward_s",
                                                     "steps/backward_s", "steps/recorder_s").write(tmp_path)
    [f] = findings(tmp_path, KIND)  # (read as "not timed": not judged)
    assert f.severity == "info" and "not checked" in f.summary and f.evidence["lacking"] == ["steps/forward_s"]


def test_the_step_the_black_box_kept_is_expected(tmp_path):
    """The black box copies the model's state inside the bad step (at the optimizer step): that
    step's backward-and-optimizer time is the recorder's, not the job's."""
    import h5py

    from tests.helpers import SAMPLES

    run().set("steps/backward_s", 1.0, at=60).write(tmp_path)
    (f,) = findings(tmp_path, KIND)  # without a black box: the job's own slow step
    assert f.step == 60
    with h5py.File(SAMPLES / "nan_birth" / "rank0.h5", "r") as src, h5py.File(tmp_path / "rank0.h5", "r+") as dst:
        src.copy(src["blackbox"], dst, "blackbox")  # (the black box of a real run, at its step 60)
        assert list(dst["blackbox/step"][()]) == [60]
    assert findings(tmp_path, KIND) == []
