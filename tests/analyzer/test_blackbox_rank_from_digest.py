"""Which rank's black box fired is told by each rank's digest (computed where the rank was
analyzed), so the reports name it without opening every rank's file again."""

from __future__ import annotations

import h5py

from tests.helpers import rank_copies
from torchautopsy.analyzer.export import fired_blackbox
from torchautopsy.analyzer.run import analyze
from torchautopsy.analyzer.trace import load
from torchautopsy.reports.terminal import analyze_lines


def test_the_rank_whose_black_box_fired_is_named_from_the_digests(tmp_path):
    run = rank_copies(tmp_path / "run", 3, sample="nan_birth")
    for r in (0, 1):  # only rank 2 keeps its black box
        with h5py.File(run / f"rank{r}.h5", "r+") as f:
            for ds in f["blackbox"].values():
                ds.resize((0, *ds.shape[1:]))
    trace = load(str(run))
    findings = analyze(trace, workers=1)
    assert [trace.digests[r].blackbox_fired for r in range(3)] == [False, False, True]
    rt, row, option = fired_blackbox(trace, prefer=0)
    assert rt.rank == 2 and option == " --rank 2"
    assert any(line.startswith("black box: rank 2 kept step") for line in analyze_lines(trace, findings))
