"""A pre-empted job restarted into its run directory, through the CLI (in this process:
tests.helpers.invoke_cli): `info` shows each attempt and the restart, `analyze` still reports
the failure of the abandoned attempt (with its attempt), the reports show the restart; an old
one-file trace reads as before; files of another run in the directory are named in one line."""

import json
import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import h5py
import pytest

from tests.helpers import SAMPLES, invoke_cli
from tests.recorder.recorder_testlib import killed_then_resumed

@pytest.fixture(scope="module")
def restarted(job_server):
    """Attempt 1 (SGD): a NaN in the batch of step 35, killed at step 41 after its checkpoint at
    30. Attempt 2: from the checkpoint, start_step=30 (SGD keeps no step count), steps 30-59.
    (Processes forked from an interpreter that imported torch: tests/forked_jobs.py.)"""
    d = tempfile.mkdtemp(prefix="restart_")
    run = killed_then_resumed(job_server, d, start="30", optimizer="sgd")
    yield d, run
    shutil.rmtree(d, ignore_errors=True)  # (this module's own directory only)


def test_info_shows_each_attempt_and_the_restart(restarted):
    _, run = restarted
    assert sorted(os.listdir(run)) == ["rank0.attempt2.h5", "rank0.h5"]
    r = invoke_cli("info", run)
    assert r.returncode == 0, r.stderr
    assert "in 2 file(s)" in r.stdout
    assert "steps        60 (0-59)" in r.stdout  # one timeline
    assert "attempt 1   rank0.h5: steps 0-41 (30 in the timeline, 12 run again by a later attempt), " \
           "not closed (killed?)" in r.stdout
    assert "attempt 2   rank0.attempt2.h5: steps 30-59 (all in the timeline), closed" in r.stdout
    assert ("rank 0 restarted at step 30 (attempt 2, file rank0.attempt2.h5): attempt 1 (rank0.h5) reached "
            "step 41, not closed (killed?); its steps 30-41 were run again") in r.stdout
    one = invoke_cli("info", os.path.join(run, "rank0.h5"))  # one attempt's file alone
    assert one.returncode == 0 and "steps        42 (0-41)" in one.stdout and "attempt" not in one.stdout


def test_analyze_reports_the_abandoned_attempts_nan_and_the_restart(restarted):
    d, run = restarted
    out = {ext: os.path.join(d, f"report.{ext}") for ext in ("json", "md", "html")}
    r = invoke_cli("analyze", run, "--json", out["json"], "--md", out["md"], "--html", out["html"],
                   "--fail-on", "error")
    assert r.returncode == 1, r.stderr  # the NaN of attempt 1 fails the check, though attempt 2 ran clean
    assert "rank 0 restarted at step 30 (attempt 2, file rank0.attempt2.h5)" in r.stdout
    findings = json.load(open(out["json"]))["findings"]
    nan = [f for f in findings if f["kind"] == "nonfinite"]
    assert nan and nan[0]["step"] == 35 and nan[0]["severity"] == "error" and nan[0]["rank"] == 0
    assert nan[0]["evidence"]["attempt"] == 1 and nan[0]["evidence"]["file"] == "rank0.h5"
    assert nan[0]["evidence"]["rerun_from_step"] == 30
    assert nan[0]["summary"].startswith("Attempt 1 (rank0.h5; a later attempt resumed at step 30")
    assert all("attempt" in f["evidence"] for f in findings)
    assert not [f for f in findings if f["evidence"]["attempt"] == 2 and f["severity"] == "error"]
    md = open(out["md"]).read()
    assert "**Restarts:**" in md and "rank 0 restarted at step 30 (attempt 2, file rank0.attempt2.h5)" in md
    html = open(out["html"]).read()
    assert "restarted at step 30 (attempt 2, file rank0.attempt2.h5)" in html


def test_an_old_single_file_trace_reads_as_before():
    """A trace written before attempts existed (a sample with its attempt attributes taken away,
    as the recorder wrote them then) reads and analyzes as it did."""
    d = tempfile.mkdtemp(prefix="restart_")
    sample = Path(d) / "old"
    sample.mkdir()
    shutil.copy(SAMPLES / "exploding_lr" / "rank0.h5", sample / "rank0.h5")
    with h5py.File(sample / "rank0.h5", "r+") as f:
        for k in ("attempt", "previous_file", "first_step"):
            if k in f.attrs:
                del f.attrs[k]
    r = invoke_cli("info", sample)
    assert r.returncode == 0 and "attempt" not in r.stdout and "restarted" not in r.stdout
    assert "in 1 file(s)" in r.stdout
    try:
        out = os.path.join(d, "f.json")
        r = invoke_cli("analyze", sample, "--json", out)
        assert r.returncode == 0 and "restarted" not in r.stdout
        findings = json.load(open(out))["findings"]
        assert findings and not any("attempt" in f["evidence"] for f in findings)
        assert not any("attempt" in f["summary"] for f in findings)
    finally:
        shutil.rmtree(d, ignore_errors=True)


MIXED = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from torchautopsy import Recorder

    torch.set_num_threads(1)
    width = int(sys.argv[2])
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1), *([nn.Tanh()] * (width > 8)))
    with Recorder(model, sys.argv[1]) as rec:
        for _ in range(5):
            rec.step(loss=model(torch.randn(3, 4)).square().mean())
""")


def test_files_of_another_run_are_named_in_one_line(jobs):
    d = tempfile.mkdtemp(prefix="restart_")
    try:
        script, run = os.path.join(d, "job.py"), os.path.join(d, "run")
        with open(script, "w") as f:
            f.write(MIXED)
        for width in (8, 8, 16):  # a restart of one run, then another model in the same directory
            jobs.run([sys.executable, script, run, str(width)], check=True, timeout=120)
        with h5py.File(os.path.join(run, "rank0.attempt2.h5"), "r+") as f:
            f.attrs["world_size"] = 2  # as if an elastic restart had changed the world size
        r = invoke_cli("info", run)
        assert r.returncode == 0, r.stderr
        notes = [line for line in r.stdout.splitlines() if line.startswith("note")]
        assert len(notes) == 2
        assert "rank0.attempt2.h5 ran with world size 2, rank0.h5 with 1" in notes[0]
        assert "rank0.attempt3.h5 records another model than rank0.attempt2.h5" in notes[1]
        assert "another run: not in the timeline" in r.stdout
        out = os.path.join(d, "f.json")
        r = invoke_cli("analyze", run, "--json", out)
        assert r.returncode == 0, r.stderr
        mixed = [f for f in json.load(open(out))["findings"] if f["kind"] == "mixed_runs"]
        assert len(mixed) == 1 and mixed[0]["severity"] == "warning"
    finally:
        shutil.rmtree(d, ignore_errors=True)
