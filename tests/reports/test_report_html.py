"""The HTML report: self-contained, complete, in the right order, escaped."""

from __future__ import annotations

import base64
import math
import re
import subprocess
import sys

from markupsafe import escape
from reports_testlib import HOSTILE_IMG, HOSTILE_LONG, HOSTILE_SCRIPT

from torchautopsy.analyzer.findings import Finding
from torchautopsy.analyzer.run import analyze
from torchautopsy.reports import build_report, render_html
from torchautopsy.reports.format import label
from torchautopsy.reports.summary import build_verdict

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def images(html: str) -> list[bytes]:
    return [base64.b64decode(b64, validate=True)
            for b64 in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


def assert_self_contained(html: str) -> None:
    lowered = html.lower()
    for ref in ("http://", "https://", "<script", "<link", "@import", "url(", "src=\"//", "<iframe",
                "<object", "<embed"):
        assert ref not in lowered, ref
    srcs = re.findall(r'\b(?:src|href)="([^"]*)"', html)
    assert all(s.startswith(("data:image/png;base64,", "#")) for s in srcs), srcs


def assert_has_findings(html: str, findings: list[Finding]) -> None:
    """Every finding's kind and summary, in the order given."""
    positions = []
    body = html[html.index('<section id="findings">'):]
    for f in findings:
        assert f.kind in body
        summary = str(escape(f.summary))
        assert summary in body, f.summary
        positions.append(body.index(summary, positions[-1] + 1 if positions else 0))
    assert positions == sorted(positions)


def test_healthy_run_says_no_problem_and_what_was_checked(healthy):
    findings = analyze(healthy)
    assert [f for f in findings if f.severity != "info"] == []
    html = render_html(healthy, findings)
    assert "No problem found" in html
    for kind in ("nonfinite", "exploding_gradients", "vanishing_gradients", "dead_relu", "memory_leak"):
        assert kind in html
    assert "closed cleanly" in html
    assert "30 steps (0-29)" in html
    assert str(escape(healthy.run_dir)) in html
    assert "Recorder settings" in html and "activations_every=" in html
    assert_self_contained(html)


def test_overview_and_appendix(healthy):
    html = render_html(healthy, [])
    for title in ("Loss", "Learning rate", "Gradient norm per layer and step", "Update-to-weight ratios",
                  "Memory", "Step time by phase", "Timeline of the findings", "What the trace holds",
                  "Parameters", "Modules"):
        assert f">{title}</h" in html, title
    assert ">AMP loss scale</h" not in html  # no GradScaler: no figure for it
    pngs = images(html)
    assert len(pngs) == 6  # all but the timeline, which has no finding to draw
    for png in pngs:
        assert png.startswith(_PNG_SIGNATURE) and png.endswith(b"IEND\xaeB`\x82")
    assert "No finding has a step to place on a timeline." in html
    rt = healthy.ranks[0]
    for name in rt.param_names:  # the per-layer table lists every parameter and module
        assert f'<td class="name">{escape(name)}</td>' in html
    assert "no GPU (device: cpu)" in html  # what was not recorded is said


def test_diverged_run_shows_every_finding_with_its_evidence_and_figure(diverged_built):
    _, findings, _, html, _ = diverged_built
    assert {"nonfinite", "exploding_gradients"} <= {f.kind for f in findings}
    assert_has_findings(html, findings)
    verdict = html[html.index('class="verdict'):html.index('<section id="findings">')]
    assert "first to go wrong" in verdict
    for f in findings:
        article = html[html.index(f'id="finding-{findings.index(f) + 1}"'):]
        article = article[:article.index("</article>")]
        for key in f.evidence:
            assert f"<th scope=\"row\">{escape(label(key))}</th>" in article  # the key as words
        assert str(escape(f.advice)) in article
        assert "<img " in article, f.kind  # each finding with a step has its own figure
    assert "could not be drawn" not in html
    assert_self_contained(html)


def test_findings_sorted_by_severity_then_step_with_nested_evidence(healthy):
    exploding = {"peak_ratio": 12345.678, "peak_norm": 12345678.9, "baseline_steps": [0, 4],
                 "growth_by_parameter": {"0.weight": 9.5, "2.weight": math.inf}, "first_nonfinite_step": None}
    leak = {"slope_bytes_per_step": 4e7,
            "window": {"steps": [10, 29], "fit": {"r2": 0.99, "deeper": {"too": {"deep": 1}}}}}
    given = [
        Finding("loss_plateau", "info", None, [""], "Loss flat since step 20.", {"loss": math.nan}, ""),
        Finding("memory_leak", "warning", 10, [], "RSS grows 38 MB/step.", leak, "A tensor kept?", rank=0),
        Finding("exploding_gradients", "error", 3, ["0.weight", "2.weight"], "Norm grew 1e4x.", exploding,
                "Lower the learning rate.", rank=0),
        Finding("dead_relu", "warning", 2, ["1"], "Half of 1 dead.", {"dead_share": 0.5}, "", rank=0),
    ]
    html = render_html(healthy, given)
    order = [given[2], given[3], given[1], given[0]]  # error; warnings by step; info
    assert_has_findings(html, order)
    for badge in ("sev-error", "sev-warning", "sev-info"):
        assert f'class="badge {badge}"' in html
    value = '<td class="text">{}</td>'.format
    assert value("12346") in html and value("1.235e+07") in html  # 4 digits, no needless exponent
    assert value("Inf") in html and value("NaN") in html and value("-") in html
    assert value("steps 0-4") in html and value("50%") in html  # a span of steps; a share
    assert '<th scope="row">Baseline steps</th>' in html and '<th scope="row">0.weight</th>' in html
    assert "(the model itself)" in html  # where = [""] is the root module
    assert "{deep: 1}" in html  # past the depth limit, nested dicts become one line
    assert "No problem found" not in html
    assert_self_contained(html)


def test_verdict_tells_the_first_problem_then_the_chain(healthy):
    findings = [
        Finding("nonfinite", "error", 12, ["2"], "NaN born in 2.", {"stage": "forward"}, "", rank=0),
        Finding("exploding_gradients", "error", 8, ["0.weight"], "Norm grew.", {"ratio_at_step": 150.0}, "", rank=0),
        Finding("dead_relu", "warning", 20, ["1"], "Dead.", {"dead_share": 0.75}, "", rank=0),
        Finding("dead_relu", "warning", 20, ["3"], "Dead too.", {"dead_share": 0.9}, "", rank=0),
        Finding("loss_plateau", "info", 25, [], "Flat.", {"loss_level": 1.0}, "", rank=0),
    ]
    v = build_verdict(findings)
    assert v.severity == "error"
    assert v.headline == "2 errors, 2 warnings; first to go wrong: exploding_gradients at step 8"
    first, then = ("".join(s.text for s in sentence) for sentence in v.sentences)
    assert first == "Gradients exploded from step 8, to 150x their early norm (fastest growth in 0.weight)."
    assert then == ("Then NaN/Inf appeared at step 12 in the forward pass of 2; "
                    "most units of 1 and 3 were dead from step 20.")  # two dead layers: one link
    assert [s.text for s in v.sentences[0] if s.code] == ["0.weight"]  # names set as code
    html = render_html(build_report(healthy, findings[1:2]))
    assert "<code>0.weight</code>" in html[html.index('class="verdict'):html.index('<section id="findings">')]


def test_names_from_the_trace_are_escaped(hostile_built):
    hostile, findings, report, html, _ = hostile_built
    param = f"{HOSTILE_IMG}.weight"
    assert param in hostile.ranks[0].param_names
    for raw in (HOSTILE_SCRIPT, HOSTILE_IMG, "<img src=x", "onerror=alert(1)>"):
        assert raw not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html           # model summary, where, evidence
    assert "&lt;img src=x onerror=alert(1)&gt;.weight" in html
    assert "Net&lt;script&gt;" in html                                # the model class
    assert f"{HOSTILE_LONG}.weight" in html                           # long names in full in tables
    assert_self_contained(html)
    drawn = [f for f in report.overview + [v.figure for v in report.findings if v.figure] if f.png]
    # hostile names in legends and ticks draw as text (the verdict repeats the first finding's figure)
    assert len(images(html)) == len(drawn) + (report.verdict.figure is not None) >= 6


def test_killed_job_is_said_in_the_header(killed):
    html = render_html(killed, analyze(killed))
    assert "the job was killed" in html
    assert '<tr class="bad"><th scope="row">Ended</th>' in html


def test_two_ranks_are_named(two_ranks):
    findings = [Finding("memory_leak", "warning", 5, [], "Leak on rank 1.", {}, "", rank=1)]
    report = build_report(two_ranks, findings)
    html = render_html(report)
    assert "2 of world size 2 (ranks 0, 1)" in html
    assert "first to go wrong: memory_leak at step 5 on rank 1" in html
    assert '<span class="when">rank 1</span>' in html
    assert report.findings[0].figure.title == "Memory over steps (rank 1)"
    assert "rank 0 resident (RSS)" not in html  # legends are in the PNG, not the text


def test_gradient_figure_draws_twelve_lines_and_counts_the_rest(wide):
    rt = wide.ranks[0]
    weights = [n for n, shape in zip(rt.param_names, rt.param_shapes) if len(shape) == 2]
    smallest = rt.param_stat("grad_norm")[weights].max().idxmin()
    named = Finding("exploding_gradients", "error", 3, [smallest], "Early layer.",
                    {"baseline_total_grad_norm": 1.0, "threshold_ratio": 100.0}, "", rank=0)
    fig = build_report(wide, [named]).findings[0].figure
    assert fig.png and fig.title == "Gradient norm per layer"
    assert "4 other weight tensors are not drawn" in fig.caption  # 16 weights, 12 lines
    assert "thin, the 11 largest others" in fig.caption  # the named one is drawn although smallest


def test_reports_import_neither_torch_nor_the_recorder():
    code = ("import sys, torchautopsy.reports; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torchautopsy.recorder')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
