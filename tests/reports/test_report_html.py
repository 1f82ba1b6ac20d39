"""The HTML report: self-contained, complete, escaped."""

from __future__ import annotations

import base64
import math
import re
import subprocess
import sys

from markupsafe import escape
from reports_testlib import HOSTILE_IMG, HOSTILE_SCRIPT

from torchautopsy.analyzer.findings import Finding
from torchautopsy.analyzer.run import analyze
from torchautopsy.reports import render_html

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def images(html: str) -> list[bytes]:
    return [base64.b64decode(b64, validate=True)
            for b64 in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


def assert_self_contained(html: str) -> None:
    lowered = html.lower()
    for ref in ("http://", "https://", "<script", "<link", "@import", "url(", "src=\"//"):
        assert ref not in lowered, ref
    srcs = re.findall(r'\bsrc="([^"]*)"', html)
    assert all(s.startswith("data:image/png;base64,") for s in srcs), srcs


def assert_has_findings(html: str, findings: list[Finding]) -> None:
    positions = []
    for f in findings:
        assert f.kind in html
        summary = str(escape(f.summary))
        assert summary in html, f.summary
        positions.append(html.index(summary, positions[-1] + 1 if positions else 0))
    assert positions == sorted(positions)  # in the order given


def test_healthy_run_says_no_problem_and_what_was_checked(healthy):
    findings = analyze(healthy)
    assert [f for f in findings if f.severity != "info"] == []
    html = render_html(healthy, findings)
    assert "No problem found" in html
    for kind in ("nonfinite", "exploding_gradients", "vanishing_gradients"):
        assert kind in html
    assert "closed cleanly" in html
    assert "30 steps (0-29)" in html
    assert str(escape(healthy.run_dir)) in html
    assert_self_contained(html)


def test_figures_are_inline_pngs(healthy):
    pngs = images(render_html(healthy, analyze(healthy)))
    assert len(pngs) == 2  # loss, gradient norms
    for png in pngs:
        assert png.startswith(_PNG_SIGNATURE) and png.endswith(b"IEND\xaeB`\x82")


def test_diverged_run_shows_every_finding_with_its_evidence(diverged):
    findings = analyze(diverged)
    assert "nonfinite" in {f.kind for f in findings}
    html = render_html(diverged, findings)
    assert_has_findings(html, findings)
    first = findings[0]
    verdict = html[html.index('class="verdict'):html.index("<h2>Findings")]
    assert first.kind in verdict and str(escape(first.summary)) in verdict
    for key in first.evidence:
        assert f"<th scope=\"row\">{escape(key)}</th>" in html
    assert str(escape(first.advice)) in html
    assert len(images(html)) == 2  # NaN and Inf in the series do not stop the plots
    assert_self_contained(html)


def test_hand_made_findings_in_order_with_nested_evidence(healthy):
    exploding = {"peak_ratio": 12345.678, "peak_norm": 12345678.9, "baseline_steps": [0, 4],
                 "growth_by_parameter": {"0.weight": 9.5, "2.weight": math.inf}, "first_nonfinite_step": None}
    leak = {"slope_bytes_per_step": 4e7,
            "window": {"steps": [10, 29], "fit": {"r2": 0.99, "deeper": {"too": {"deep": 1}}}}}
    findings = [
        Finding("exploding_gradients", "error", 3, ["0.weight", "2.weight"], "Norm grew 1e4x.", exploding,
                "Lower the learning rate.", rank=0),
        Finding("memory_leak", "warning", 10, [], "RSS grows 38 MB/step.", leak, "A tensor kept?", rank=1),
        Finding("loss_plateau", "info", None, [""], "Loss flat since step 20.", {"loss": math.nan}, ""),
    ]
    html = render_html(healthy, findings)
    assert_has_findings(html, findings)
    for badge in ("sev-error", "sev-warning", "sev-info"):
        assert f'class="badge {badge}"' in html
    value = '<td class="text">{}</td>'.format
    assert value("12346") in html and value("1.235e+07") in html  # 4 digits, no needless exponent
    assert value("Inf") in html and value("NaN") in html and value("-") in html
    assert value("[0, 4]") in html
    assert "(the model itself)" in html  # where = [""] is the root module
    assert "{deep: 1}" in html     # past the depth limit, nested dicts become one line
    assert "No problem found" not in html
    assert_self_contained(html)


def test_names_from_the_trace_are_escaped(hostile):
    param = f"{HOSTILE_IMG}.weight"
    assert param in hostile.ranks[0].param_names
    findings = analyze(hostile) + [Finding(
        "vanishing_gradients", "warning", 2, [param, HOSTILE_SCRIPT], f"Tiny gradient in {param}.",
        {"early_grad_rms": {param: 1e-9}, HOSTILE_SCRIPT: HOSTILE_IMG}, f"Check {HOSTILE_SCRIPT}.", rank=0)]
    html = render_html(hostile, findings)
    for raw in (HOSTILE_SCRIPT, HOSTILE_IMG, "<img src=x", "onerror=alert(1)>"):
        assert raw not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html           # model summary, where, evidence
    assert "&lt;img src=x onerror=alert(1)&gt;.weight" in html
    assert "Net&lt;script&gt;" in html                                # the model class
    assert_self_contained(html)
    assert len(images(html)) == 2  # hostile names in the plot legend draw as text


def test_killed_job_is_said_in_the_header(killed):
    html = render_html(killed, analyze(killed))
    assert "the job was killed" in html
    assert '<tr class="bad"><th scope="row">Ended</th>' in html


def test_two_ranks_are_named(two_ranks):
    html = render_html(two_ranks, analyze(two_ranks))
    assert "2 of world size 2 (ranks 0, 1)" in html
    assert len(images(html)) == 2


def test_wide_model_draws_twelve_lines_and_says_which_not(wide):
    def not_drawn(html: str) -> list[str]:
        tail = html[html.index("not drawn: 4 (") + len("not drawn: 4 ("):]
        return tail[:tail.index(")")].split(", ")

    html = render_html(wide, [])
    assert "each of the 16 weight matrices" in html
    assert "Only 12 are drawn: those the findings name, then the largest; not drawn: 4 (" in html
    rt = wide.ranks[0]
    weights = [n for n, shape in zip(rt.param_names, rt.param_shapes) if len(shape) == 2]
    smallest = rt.param_stat("grad_norm")[weights].max().idxmin()
    assert smallest in not_drawn(html)
    named = Finding("vanishing_gradients", "warning", 3, [smallest], "Early layer.", rank=0)
    assert smallest not in not_drawn(render_html(wide, [named]))  # a layer a finding names is drawn


def test_reports_import_neither_torch_nor_the_recorder():
    code = ("import sys, torchautopsy.reports; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torchautopsy.recorder')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
