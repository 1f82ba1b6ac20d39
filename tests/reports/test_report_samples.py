"""Reports of the shipped sample traces (real runs that went wrong in each way the analyzer
knows): every finding in the HTML and the PDF with its own figure, within the size bounds."""

from __future__ import annotations

import json

import pytest
from markupsafe import escape
from reports_testlib import SAMPLES, pdf_pages_text, sample_cases, sample_report, squeeze
from test_report_html import assert_self_contained, images

from torchautopsy.reports.build import MAX_FIGURES

MAX_HTML_BYTES = 3 * 2**20  # the bound for the sample traces
FIRST_SCREEN = "nan_birth"  # the sample whose first screen and step-time figure are checked


def one_case_per_kind() -> list[str]:
    """The first sample of each expected kind (and one healthy run): every kind's figure is drawn
    without building all the samples, which would take most of the tests' time."""
    if not sample_cases():
        return []
    expected = json.loads((SAMPLES / "expected.json").read_text())
    chosen: dict = {}
    # nan_birth first: the tests below read its report, so its kind's is built once, not twice (~6 CPU-s).
    for case in sorted(expected, key=lambda c: (c != FIRST_SCREEN, c)):
        chosen.setdefault(expected[case]["kind"], case)
    return sorted(chosen.values())


@pytest.mark.parametrize("case", one_case_per_kind() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no sample traces (sample_traces/expected.json)"))])
def test_sample_report(case):
    trace, findings, report, html, pdf = sample_report(case)
    assert len(html.encode()) < MAX_HTML_BYTES and len(pdf) < MAX_HTML_BYTES
    assert_self_contained(html)
    text = squeeze("\n".join(pdf_pages_text(pdf)))
    for i, (f, view) in enumerate(zip(findings, report.findings)):
        assert str(escape(f.summary)) in html, f.kind
        assert squeeze(f.summary) in text, f.kind
        if f.step is not None and i < MAX_FIGURES:
            assert view.figure is not None, f.kind  # each finding with a step has a figure ...
            assert view.figure.png or "shows this one too" in view.figure.caption, (f.kind, view.figure.caption)
    captions = [fig.caption for fig in report.overview] + [v.figure.caption for v in report.findings if v.figure]
    assert not [c for c in captions if "could not be drawn" in c]
    assert "could not be drawn" not in html  # nor any other figure (the value distributions)
    drawn = [fig for fig in report.overview if fig.png]
    assert len(drawn) >= 3  # loss, gradient heatmap, memory at least
    # (the first finding's figure is drawn twice: under the verdict, and with its finding)
    assert len(images(html)) == len(drawn) + sum(1 for v in report.findings if v.figure and v.figure.png) \
        + (report.verdict.figure is not None) + sum(1 for fig in report.ranks if fig.png)
    assert 1 <= len(pdf_pages_text(pdf)) <= 40


def test_the_first_screen_is_the_verdict():
    """The run in one line, the verdict with its one-line fix and the first cause's figure, the
    list of findings; the recorder's settings and the run's details in the appendix."""
    trace, findings, report, html, pdf = sample_report(FIRST_SCREEN)
    verdict, listing = html.index('class="verdict'), html.index('class="finding-list"')
    assert html.index('class="run"') < verdict < listing < html.index('<section id="findings">')
    assert "Adam, lr 0.001" in report.run_line and "closed cleanly" in report.run_line
    box = html[verdict:listing]
    assert "Fix first:" in box and "<img" in box and report.verdict.fix.startswith("Find the operation")
    assert html.index("Recorder settings") > html.index('<section id="appendix">')
    first_page = squeeze(pdf_pages_text(pdf)[0])
    assert squeeze(report.verdict.headline) in first_page and "Fixfirst:" in first_page
    assert "Recordersettings" not in first_page and "features.log" in first_page


def test_the_recorders_profiler_window_is_labelled_in_the_step_time_figure():
    """The profiler window slows the steps it records (issue 24: the recorder's cost is not the
    user's problem): the step-time figure shades them and says so."""
    trace, findings, report, html, pdf = sample_report(FIRST_SCREEN)
    fig = next(f for f in report.overview if f.title.startswith("Step time by phase"))
    assert fig.png and "the recorder's torch.profiler windows (steps 10-11)" in fig.caption
