"""``--scheduler`` on the command line (analyzer/cluster.py): ``local:N`` runs the per-rank pass
on a local Dask cluster and writes what the default path writes, for ``analyze`` and ``diff``; an
address that is not one, a scheduler that does not answer, or Dask not installed: one line on
stderr and exit code 2, before any trace is read."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import SAMPLES, invoke_cli, run_cli

RUN = SAMPLES / "ddp_hang"
# local:1: the pass still runs in a worker process of a cluster this process starts; a second worker
# cost ~2-3 CPU-s a test, and ranks spread over two workers are tests/analyzer/test_cluster.py's.


@pytest.mark.slow  # (a subprocess each, and a local cluster's worker processes: ~15 s)
def test_analyze_on_a_local_cluster_writes_what_local_workers_write(tmp_path):
    on_dask = run_cli("analyze", RUN, "--scheduler", "local:1", "--json", tmp_path / "dask.json", timeout=300)
    assert on_dask.returncode == 0 and on_dask.stderr == "", on_dask.stderr
    local = invoke_cli("analyze", RUN, "--json", tmp_path / "local.json")
    assert on_dask.stdout.replace("dask.json", "local.json") == local.stdout
    found = json.loads((tmp_path / "dask.json").read_text())["findings"]
    assert found == json.loads((tmp_path / "local.json").read_text())["findings"]
    assert [(f["kind"], f["rank"], f["step"]) for f in found if f["severity"] == "error"] == [("hang", 2, 40)]


@pytest.mark.slow  # (as above)
def test_diff_on_a_local_cluster_gives_the_same_comparison(tmp_path):
    a, b = SAMPLES / "ddp_straggler", RUN
    on_dask = run_cli("diff", a, b, "--scheduler", "local:1", "--json", tmp_path / "dask.json", timeout=300)
    assert on_dask.returncode == 0 and on_dask.stderr == "", on_dask.stderr
    assert invoke_cli("diff", a, b, "--json", tmp_path / "local.json").returncode == 0
    assert json.loads((tmp_path / "dask.json").read_text()) == json.loads((tmp_path / "local.json").read_text())
    assert json.loads((tmp_path / "dask.json").read_text())["new_findings"]["b"]  # (B's hang: found on the cluster)


@pytest.mark.slow  # (a subprocess)
def test_a_scheduler_that_does_not_answer_is_one_line_and_exit_2():
    # (a port nothing listens on: the host refuses, told at once rather than after the connect timeout)
    r = run_cli("analyze", RUN, "--scheduler", "tcp://127.0.0.1:9", timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [r.stderr.strip()] and "Traceback" not in r.stderr
    assert r.stderr.startswith("Error: --scheduler tcp://127.0.0.1:9: could not reach the Dask scheduler "
                               "(connection refused"), r.stderr


@pytest.mark.parametrize("address", ["local:0", "local:two", "tcp://", "no such host", "a/b"])
def test_an_address_that_is_not_one_is_one_line_and_exit_2(address):
    r = invoke_cli("analyze", RUN, "--scheduler", address)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"Error: --scheduler {address!r}: "), r.stderr


def test_without_dask_the_scheduler_asks_for_the_cluster_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # (an import of it now fails, as without the extra)
    r = invoke_cli("analyze", RUN, "--scheduler", "local:2")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == 'Error: --scheduler needs Dask, which is not installed: pip install "torchautopsy[cluster]"\n'
