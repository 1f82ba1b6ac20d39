"""A run directory of many rank files shows progress from its first second (issue 38, point 4: 10,000
rank files gave no output within 60 s). Opening the files is a fixed cost a file (each is decoded
in a child process with a deadline, then opened), paid before anything can be printed: the bar on
stderr says how far it is, for ``info`` as for ``analyze``, and the results still name every rank.

Real CLI runs (in this process: tests.helpers.invoke_cli) on copies of a real trace
(sample_traces/healthy_mlp), each given its own rank as the recorder writes it under DDP (the
``rank`` and ``world_size`` attributes).
"""

import json

import pytest

from tests.helpers import invoke_cli, rank_copies

N_RANKS = 6


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    return rank_copies(tmp_path_factory.mktemp("many") / "run", N_RANKS)


@pytest.mark.parametrize("command", ["analyze", "info"])
def test_opening_the_rank_files_shows_progress(many, tmp_path, command, monkeypatch):
    monkeypatch.setenv("TORCHAUTOPSY_PROGRESS", "1")
    args = [command, many] + (["--json", tmp_path / "f.json"] if command == "analyze" else [])
    r = invoke_cli(*args)
    assert r.returncode == 0, r.stderr
    assert f"rank files checked: {N_RANKS} of {N_RANKS}" in r.stderr, r.stderr
    assert "rank files opened:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    if command == "analyze":
        assert f"{N_RANKS} ranks" in r.stdout.splitlines()[0]
        found = json.loads((tmp_path / "f.json").read_text())["findings"]
        # (the sample's older recorder left three columns out: their detectors say "not checked")
        assert all(f["severity"] == "info" and "not checked" in f["summary"] for f in found), found
        assert f"ranks analyzed: {N_RANKS} of {N_RANKS}" in r.stderr
    else:
        assert [f"rank {k} of {N_RANKS}" in r.stdout for k in range(N_RANKS)] == [True] * N_RANKS

