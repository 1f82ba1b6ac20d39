"""recording_stopped: a trace the recorder closed on its own error says so; it never reads "no
problem found" about steps it never saw (issue 36), and its end is not taken for a hang."""

import numpy as np

from tests.helpers import invoke_cli
from tests.tracebuilder import TraceBuilder, findings

KIND = "recording_stopped"
ERROR = "recorder error: AttributeError: 'NoneType' object has no attribute 'detach'"


def test_a_recording_stopped_by_a_recorder_error_is_a_warning_at_the_step_it_stopped(tmp_path):
    TraceBuilder.mlp(steps=30).loss(1.0).attrs(end_reason=ERROR, n_steps_recorded=30).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 30, [])
    assert f.evidence == {"reason": ERROR.removeprefix("recorder error: "), "steps_recorded": 30,
                          "stopped_at_step": 30}
    assert "30 steps recorded before it (0-29)" in f.summary and "AttributeError" in f.summary


def test_a_recording_stopped_before_its_first_step_checked_nothing_and_says_so(tmp_path):
    b = TraceBuilder.mlp(steps=0).attrs(end_reason=ERROR, n_steps_recorded=0)
    # the heartbeat saw step 0 run long (its first compile) before the recorder stopped: no hang
    b.heartbeats([{"time_unix": 1.0, "step": 0, "phase": "forward", "phase_s": 20.0, "step_s": 20.0,
                   "typical_step_s": float("nan"), "stack": ""}])
    b.write(tmp_path)
    kinds = [(f.kind, f.severity, f.step) for f in findings(tmp_path) if f.severity != "info"]
    assert kinds == [(KIND, "warning", 0)]
    r = invoke_cli("analyze", tmp_path)
    assert r.returncode == 0 and "No problem found" not in r.stdout, r.stdout
    assert "Recording stopped at step 0" in r.stdout and "nothing about the training could be checked" in r.stdout


def test_other_ends_are_quiet(tmp_path):
    for i, reason in enumerate(["closed", "exit", "sigterm", "exception: RuntimeError: boom"]):
        TraceBuilder.mlp(steps=20).loss(np.linspace(2, 1, 20)).attrs(end_reason=reason).write(tmp_path / str(i))
        assert findings(tmp_path / str(i), KIND) == []
    TraceBuilder.mlp(steps=20).loss(1.0).attrs(closed=False, end_reason=ERROR).write(tmp_path / "killed")
    assert findings(tmp_path / "killed", KIND) == []
