"""Reports stay bounded: thousands of layers, thousands of steps, hundreds of findings."""

from __future__ import annotations

from reports_testlib import pdf_page_count, pdf_pages_text

from torchautopsy import load
from torchautopsy.analyzer.findings import Finding
from torchautopsy.reports import build_report, render_html, render_pdf
from torchautopsy.reports.appendix import MAX_ROWS
from torchautopsy.reports.build import MAX_FIGURES, MAX_FULL_FINDINGS
from torchautopsy.reports.overview import HEATMAP_ROWS


def test_many_layers_are_cut_and_counted(wide_many_dir):
    trace = load(wide_many_dir)
    rt = trace.ranks[0]
    assert len(rt.param_names) == 1200 and len(rt.module_names) == 1201
    named = rt.param_names[-1]
    finding = Finding("exploding_gradients", "error", 3, [named], "The last layer exploded.",
                      {"baseline_total_grad_norm": 1.0, "threshold_ratio": 100.0}, "", rank=0)
    report = build_report(trace, [finding])
    params, modules = report.tables[:2]  # then the memory peak and profiler tables, when recorded
    assert len(params.rows) == MAX_ROWS and params.more.startswith("1,000 more parameters not shown")
    assert named in [row[0] for row in params.rows]  # the layer a finding names is kept
    assert len(modules.rows) == MAX_ROWS and modules.more.startswith("1,001 more modules not shown")
    heatmap = next(f for f in report.overview if f.title.startswith("Gradient norm per layer and step"))
    assert "of each of the 600 weight matrices" in heatmap.caption
    assert "Each row is the largest norm over a group of consecutive tensors" in heatmap.caption
    assert heatmap.height_in <= 7.5 and HEATMAP_ROWS == 48
    assert "other weight tensors are not drawn." in report.findings[0].figure.caption
    html, pdf = render_html(report), render_pdf(report)
    assert len(html) < 1_500_000 and len(pdf) < 1_500_000
    assert pdf_page_count(pdf) <= 20


def test_long_runs_are_bucketed_and_zoomed(long_dir):
    trace = load(long_dir)
    assert trace.ranks[0].n_steps == 3000
    finding = Finding("exploding_gradients", "error", 2500, ["2.weight"], "Late explosion.",
                      {"baseline_total_grad_norm": 1.0, "threshold_ratio": 100.0}, "", rank=0)
    report = build_report(trace, [finding])
    heatmap = next(f for f in report.overview if f.title.startswith("Gradient norm per layer and step"))
    assert "Each column is the largest norm over 8 steps." in heatmap.caption
    assert "Steps 1,500-2,700 around the event; the overview shows the whole run." in report.findings[0].figure.caption
    assert len(render_html(report)) < 1_000_000


def test_hundreds_of_findings_are_listed_not_drawn(healthy):
    findings = [Finding("dead_relu" if i % 2 else "update_ratio", "warning", i % 30, [f"{i}.weight"],
                        f"Finding number {i}.", {"i": i}, "Advice.", rank=0) for i in range(300)]
    report = build_report(healthy, findings)
    assert len(report.findings) == MAX_FULL_FINDINGS
    assert report.more_findings is not None and len(report.more_findings.rows) == 300 - MAX_FULL_FINDINGS
    drawn = [v for v in report.findings if v.figure is not None and v.figure.png]
    assert len(drawn) <= MAX_FIGURES
    captions = [f.caption for f in report.overview] + [v.figure.caption for v in report.findings if v.figure]
    assert not [c for c in captions if "could not be drawn" in c]  # 300 marks, legends still fit
    html = render_html(report)
    assert "Finding number 299." in html  # every finding is at least listed
    assert "270 more findings" in html
    pages = pdf_pages_text(render_pdf(report))
    assert len(pages) <= 40 and "Findingnumber299." in "".join("".join(pages).split())
