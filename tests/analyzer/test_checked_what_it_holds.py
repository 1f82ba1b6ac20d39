"""A detector is "checked" only when the file itself holds what it needs: a column that
upgrade.py fills in for an older trace ("not measured") never counts. Each such column left out
of a trace makes its detectors say "not checked", in one line of the reports."""

from __future__ import annotations

import pytest

from tests.tracebuilder import TraceBuilder, findings
from torchautopsy.analyzer.detectors import DETECTORS
from torchautopsy.analyzer.run import checked_kinds, not_checked_line
from torchautopsy.analyzer.trace import load, upgrade
from torchautopsy.reports.build import build_report
from torchautopsy.reports.markdown import render_markdown
from torchautopsy.reports.terminal import analyze_lines

FILLED = sorted({name for det in DETECTORS for name in det.REQUIRES if upgrade.added(name)})


def _trace(tmp_path, *without):
    b = TraceBuilder.mlp(layers=3, steps=40).loss(1.0).total_grad_norm(1.0)
    return b.without(*without).write(tmp_path)


def test_some_required_columns_are_filled_in_for_older_traces():
    assert {"steps/input_mean", "steps/grads_kept", "steps/train_mode"} <= set(FILLED)


@pytest.mark.parametrize("name", FILLED)
def test_a_trace_lacking_a_filled_column_does_not_count_its_detectors_as_checked(tmp_path, name):
    _trace(tmp_path, name)
    needing = {det.KIND for det in DETECTORS if name in det.REQUIRES}
    found = findings(tmp_path)
    checked = set(checked_kinds(found))
    assert not needing & checked, (name, needing & checked)
    said = {f.kind: f.evidence["lacking"] for f in found if f.severity == "info" and "not checked" in f.summary}
    assert all(name in said[kind] for kind in needing), said
    line = not_checked_line(found)
    assert line.startswith("Not checked, as this trace does not hold what they need: ")
    assert all(kind in line for kind in needing) and name in line  # (detectors of one reason: "a, b (...)")


def test_a_trace_holding_every_column_is_checked_by_every_detector(tmp_path):
    _trace(tmp_path)
    found = findings(tmp_path)
    assert set(checked_kinds(found)) >= {det.KIND for det in DETECTORS}, not_checked_line(found)
    assert not_checked_line(found) is None


def test_the_reports_say_it_in_one_line_not_a_finding_each(tmp_path):
    _trace(tmp_path, "steps/input_mean", "steps/grads_kept", "steps/train_mode")
    trace = load(str(tmp_path))
    found = findings(tmp_path)
    text = "\n".join(analyze_lines(trace, found))
    assert text.count("Not checked, as this trace does not hold what they need") == 1
    assert "input_data (steps/input_mean)" in text and "missing_zero_grad (steps/grads_kept)" in text
    assert "not checked: this trace lacks" not in text  # no finding line each
    assert "input_data" not in text.split("No problem found (checked:")[1].split(")")[0]
    md = render_markdown(trace, found)
    assert md.count("Not checked, as this trace does not hold") == 1 and "| info |" not in md
    report = build_report(trace, found)  # the HTML's and the PDF's: in the verdict, not as findings
    assert report.verdict.not_checked == not_checked_line(found) and report.verdict.n_notes == 0
    assert not any("not checked" in v.summary for v in report.findings)


def test_a_detector_whose_data_lacked_something_says_what_in_the_line(tmp_path):
    """Not checked for want of the run's data, not of a column (no gradient at rec.step(), no loss
    given): the line gives that reason, once for the detectors that share it."""
    TraceBuilder.mlp(layers=3, steps=40).write(tmp_path)  # no gradient, no loss given
    line = not_checked_line(findings(tmp_path))
    assert "exploding_gradients, vanishing_gradients (no parameter had a gradient when rec.step() was called" in line
    assert "loss_divergence, loss_plateau (rec.step() was not given the loss in any of the 40 steps" in line
    assert " ()" not in line  # (a reason for every kind)
