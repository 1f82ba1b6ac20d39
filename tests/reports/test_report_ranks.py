"""The report's Ranks section on a many-rank run (issue 26): the ranks x steps pictures, in which
the odd rank's row is the one that stands out, and the table of where each rank's trace ended;
in the HTML and in the PDF; none for one rank; rows grouped past 96 ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest
from reports_testlib import pdf_pages_text, squeeze

from tests.analyzer.detectors.test_cross_rank import RANKS, _stall, rank
from tests.analyzer.test_counters import _rank
from torchautopsy.analyzer.cross_rank import counters
from torchautopsy.analyzer.run import analyze
from torchautopsy.analyzer.trace import load
from torchautopsy.reports import build_report, render_html, render_pdf
from torchautopsy.reports import plots
from torchautopsy.reports import ranks as rank_section
from torchautopsy.reports.context import Context
from torchautopsy.analyzer.config import AnalysisConfig

TITLES = ("Ranks: own work per step", "Ranks: backward and optimizer per step", "Ranks: loss per step",
          "Ranks: gradient norm per step", "Ranks: memory per step", "Ranks: replica fingerprints")


def straggler_then_hang(tmp_path):
    """4 ranks: rank 3 straggles in its data loading from step 60; at step 150 rank 1 stops in
    its data loading and the others wait in backward until the job is killed."""
    bs = [rank(r, steps=150) for r in range(RANKS)]
    bs[3].set("steps/data_wait_s", 0.06, at=slice(60, None))
    bs[3].set("steps/between_steps_s", 0.062, at=slice(60, None))
    for b in bs[:3]:
        b.set("steps/backward_s", b.cols["steps/backward_s"] + np.where(b.steps >= 60, 0.055, 0))
    _stall(bs[1], 150, "data", 61, "batch = next(it)")
    for r in (0, 2, 3):
        _stall(bs[r], 150, "backward", 64, "loss.backward()")
    for r, b in enumerate(bs):
        b.write(tmp_path, rank=r)
    trace = load(tmp_path)
    return trace, analyze(trace, workers=2)


def test_the_ranks_section_shows_the_straggler_and_where_each_rank_stopped(tmp_path):
    trace, findings = straggler_then_hang(tmp_path)
    assert {(f.kind, f.rank, f.step) for f in findings if f.kind in ("hang", "straggler")} == \
        {("hang", 1, 150), ("straggler", 3, 60)}
    report = build_report(trace, findings)
    assert [f.title for f in report.ranks] == list(TITLES)
    assert all(f.png for f in report.ranks), [f.caption for f in report.ranks if not f.png]
    t = report.rank_table
    assert t.rows[0][:5] == ("1", "149", "killed (not closed)", "step 150, data", "train.py:61")
    assert t.rows[1][:5] == ("0-3 except 1", "149", "killed (not closed)", "step 150, backward", "train.py:64")
    # The picture's data: rank 3's own work stands out from step 60, the others' do not.
    ctx = Context(trace, findings, AnalysisConfig())
    ds = rank_section.digests(ctx)
    dev, _, _, labels, edges = rank_section._cells(ds, "own")  # (150 steps: a bucket a step)
    assert len(labels) == RANKS and list(edges[:-1]) == list(range(150))
    after = edges[:-1] >= 60
    assert dev[3, after].min() > 0.5 and np.abs(dev[:3, after]).max() < 0.3 and np.abs(dev[:, ~after]).max() < 0.3

    html = render_html(report)
    assert 'id="ranks"' in html and html.index('id="ranks"') < html.index('id="overview"')
    for title in (*TITLES, "How each rank&#39;s trace ends"):
        assert title in html, title
    text = squeeze("\n".join(pdf_pages_text(render_pdf(report))))
    for title in (*TITLES, "How each rank's trace ends"):
        assert squeeze(title) in text, title


def test_one_rank_has_no_ranks_section(tmp_path):
    rank(0).attrs(world_size=1).write(tmp_path)
    trace = load(tmp_path)
    report = build_report(trace, analyze(trace))
    assert report.ranks == () and report.rank_table is None
    assert 'id="ranks"' not in render_html(report)


@pytest.fixture(scope="module")
def many_ranks(tmp_path_factory):
    """(trace, findings) of one run past MAX_ROWS ranks (97), shared by the tests past 40 and past
    96 ranks (~0.2 CPU-s a rank to write, check and analyze): 20 steps, rank 77 slow in its
    forward from step 10 (a straggler: it shows from step 10 as at 40); at step 20 rank 41 stops
    in its data loading, ranks 42 and 43 in their forward, the others wait in backward until the
    job is killed (the stall is after the last step: the steps' pictures do not show it)."""
    n = rank_section.MAX_ROWS + 1
    run = tmp_path_factory.mktemp("many_ranks")
    for r in range(n):
        b = rank(r, steps=20).attrs(world_size=n)
        if r == 77:
            b.set("steps/forward_s", 0.3, at=slice(10, None))
        phase = "data" if r == 41 else "forward" if r in (42, 43) else "backward"
        _stall(b, 20, phase, {"data": 61, "forward": 62, "backward": 64}[phase], "x = f()", seconds=30)
        b.write(run, rank=r)
    trace = load(str(run))
    return trace, analyze(trace, workers=1)  # (worker processes: straggler_then_hang, tests/analyzer/test_parallel.py)


def test_past_96_ranks_the_rows_are_groups_and_the_odd_rank_still_shows(many_ranks):
    trace, findings = many_ranks
    assert len(trace.ranks) > rank_section.MAX_ROWS  # (past it the rows become groups)
    assert [(f.rank, f.step) for f in findings if f.kind == "straggler"] == [(77, 10)]
    ctx = Context(trace, findings, AnalysisConfig())
    figs = rank_section.figures(ctx)
    assert figs[0].png and "groups of ranks" in figs[0].caption
    dev, _, _, labels, _ = rank_section._cells(rank_section.digests(ctx), "own")
    assert len(labels) <= rank_section.MAX_ROWS and any(lab.startswith("ranks ") for lab in labels)
    row = next(i for i, lab in enumerate(labels) if lab == "rank 77" or (
        lab.startswith("ranks ") and int(lab.split()[1].split("-")[0]) <= 77 <= int(lab.split("-")[-1])))
    assert dev[row].max() >= 1 and np.sort(np.abs(dev).max(axis=1))[-2] < 0.5  # that group's row alone


def test_the_first_screen_says_each_way_the_ranks_ended_once_and_a_whole_fix():
    """sample_traces/ddp_hang (issue 36): its "Fix first" sentence was cut inside a parenthesis
    ("... only some ranks call (e.g."), and the ranks' endings came twice, with gloo's source paths."""
    from pathlib import Path

    trace = load(str(Path(__file__).parents[2] / "sample_traces" / "ddp_hang"))
    report = build_report(trace, analyze(trace, workers=1))
    assert report.verdict.fix.endswith("(e.g. under `if rank == 0:`).")
    header = render_html(report).split("</header>")[0]
    ended = [line for line in header.split("\n") if "Ended:" in line]
    assert [line.split("Ended: ")[1].split(":")[0] for line in ended] == ["ranks 0-1", "rank 2", "rank 3"]
    assert "gloo" not in header and "unbound_buffer.cc" not in header
    assert report.run_line.endswith("lr 0.001")  # (the endings are those lines, not repeated in it)


@pytest.mark.parametrize("n, skew", [(7, 0.7), (300, 0.97), (300, 0.4)])
def test_the_replica_picture_from_the_counters_is_the_picture_of_every_ranks_rows(n, skew):
    """The replica picture is drawn from the merged counters (per step the majority and the
    ranks that left it), not from every rank's fingerprint row: its cells equal those of the
    ranks x steps matrix of every rank's hashes, grouped as before, past 96 ranks too; ranks
    whose fingerprints stop early are grey there, as before."""
    rng = random.Random(n)
    ranks = {r: _rank(r, rng, skew) for r in range(n)}
    for d in ranks.values():
        d.replicated = True
    for r in range(4):  # (the first row's ranks stop early: grey there)
        ranks[r].fp_steps, ranks[r].fp_hash = ranks[r].fp_steps[:10], ranks[r].fp_hash[:10]
    fp = counters.of(ranks, None).fingerprints
    dev, missing, labels, x_edges = rank_section.replica_cells(fp)

    steps = np.unique(np.concatenate([d.fp_steps for d in ranks.values()]))
    h = np.zeros((n, len(steps)), dtype=np.int64)
    absent = np.ones(h.shape, dtype=bool)
    for r, d in ranks.items():
        pos = np.searchsorted(steps, d.fp_steps)
        h[r, pos], absent[r, pos] = d.fp_hash, False
    differs = np.zeros(h.shape, dtype=bool)
    for k in range(len(steps)):
        values = [int(v) for v in h[~absent[:, k], k]]
        if values:  # (the majority: the most common hash, ties to the one whose first rank is smaller)
            top = min(set(values), key=lambda v: (-values.count(v), values.index(v)))
            differs[:, k] = (h[:, k] != top) & ~absent[:, k]
    cols = plots.bucket_edges(len(steps), rank_section.MAX_COLS)
    want = rank_section._by_rows(*rank_section._by_columns(np.where(differs, 4.0, 0.0), np.zeros(h.shape, dtype=bool),
                                                           absent, cols), list(ranks))
    np.testing.assert_array_equal(dev, want[0])
    np.testing.assert_array_equal(missing, want[2])
    assert labels == want[3] and list(x_edges[:-1]) == steps.tolist()
    assert dev.any() and missing.any() and (len(labels) < n) == (n > rank_section.MAX_ROWS)


def test_past_40_ranks_the_hang_figure_draws_the_ranks_that_stopped_elsewhere_first(many_ranks):
    """97 ranks: rank 41 stops in its data loading, ranks 42 and 43 in their forward, the others
    wait in backward. The hang figure draws 40 rows: the named rank, those that stopped elsewhere
    than most ranks (from the counters: the Lights keep no heartbeats), then the others; the ends
    table groups every rank by its Light's last heartbeat."""
    from torchautopsy.reports.sections import hang as hang_section

    trace, findings = many_ranks
    (f,) = [f for f in findings if f.kind == "hang"]
    assert (f.rank, f.step) == (41, 20)
    ctx = Context(trace, findings, AnalysisConfig())
    drawn = hang_section._drawn(ctx, f, rank_section.digests(ctx))
    assert drawn == [41, 42, 43] + list(range(37))
    fig = hang_section.figure_for(ctx, f)
    assert fig.png and "40 of them: the odd ones first" in fig.caption
    rows = rank_section.end_table(ctx).rows
    assert [r[:4] for r in rows] == [("41", "19", "killed (not closed)", "step 20, data"),
                                     ("42-43", "19", "killed (not closed)", "step 20, forward"),
                                     ("0-96 except 41-43", "19", "killed (not closed)", "step 20, backward")]
