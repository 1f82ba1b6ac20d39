"""Thousands of ranks stay readable (issue 41): a finding on all ranks but one reads "ranks
0-4095 except 17", and a Ranks picture whose rows are groups of ranks names, in its caption, the
ranks with findings and the row that holds each."""

from __future__ import annotations

from torchautopsy.analyzer.cross_rank.merge import rank_set
from torchautopsy.reports import plots
from torchautopsy.reports.ranks import MAX_ROWS, _odd_in_groups


def test_a_finding_on_all_ranks_but_one_names_the_one():
    assert rank_set([r for r in range(4096) if r != 17], range(4096)) == "ranks 0-4095 except 17"
    assert rank_set([17, 4000], range(4096)) == "ranks 17, 4000"


def test_grouped_rows_name_the_ranks_with_findings_and_their_row():
    ranks = list(range(1024))
    edges = plots.bucket_edges(len(ranks), MAX_ROWS)
    labels = [f"ranks {a}-{b - 1}" for a, b in zip(edges[:-1], edges[1:])]
    points = [(17, 6000, "warning"), (42, 3000, "error"), (5, 9990, "error"), (17, 7000, "warning")]
    assert _odd_in_groups(points, ranks, labels) == \
        " Ranks with findings: 5 (row ranks 0-9), 17 (row ranks 10-20), 42 (row ranks 42-52)."
    assert _odd_in_groups(points, ranks[:8], [f"rank {r}" for r in ranks[:8]]) == ""  # (a row each: the rows say it)
