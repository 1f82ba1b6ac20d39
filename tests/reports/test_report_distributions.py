"""Issue 6 in the reports: histograms over steps, weights before/after the first finding, and
what the trace holds (snapshots, samples, black box) in the appendix and the Markdown."""

from __future__ import annotations

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze
from torchautopsy.reports import build_report, render_html, render_markdown, render_pdf


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


@pytest.fixture(scope="module")
def nan_trace(tmp_path_factory):
    """NaN born in `<b>exp</b>` (a name that must stay text in HTML) at step 12 of 30."""
    run_dir = tmp_path_factory.mktemp("dist") / "run"
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(6, 12))
    model.add_module("<b>exp</b>", Exp())
    model.add_module("out", nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 6, generator=g) * (1e3 if step == 12 else 1)
        return x, torch.randint(0, 3, (8,), generator=g)

    train(model, run_dir, 30, batch, F.cross_entropy, optimizer=opt, histogram_every=2, snapshot_every=5,
          profile_steps=0)
    return load(run_dir)


def test_histograms_and_weights_before_after_in_the_report(nan_trace):
    findings = analyze(nan_trace)
    report = build_report(nan_trace, findings)
    titles = [f.title for f in report.overview]
    assert "Value distributions over steps: all layers" in titles or any(
        t.startswith("Value distributions over steps") for t in titles)
    before_after = next(f for f in report.overview if f.title == "Weights before and after the first finding")
    assert before_after.png is not None
    assert "black box, start of step 12" not in before_after.caption  # the caption names the layer and step
    assert "step 12" in before_after.caption
    html = render_html(report)
    assert "black box holds the parameters of step 12 before its bad update" in html
    assert "<b>exp</b>" not in html and "&lt;b&gt;exp&lt;/b&gt;" in html
    assert "fired at step 12 (grad_nonfinite)" in html
    assert "the parameters at steps 0, 5, 10, 15, 20, 25, 30 " in html
    pdf = render_pdf(report)
    assert pdf.startswith(b"%PDF") and len(pdf) < 5 * 2**20
    md = render_markdown(nan_trace, findings)
    assert len(md.splitlines()) <= 40
    assert "**Black box:** rank 0, step 12" in md and "--params blackbox" in md
