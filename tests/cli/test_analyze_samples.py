"""Each shipped sample trace gives its expected finding through the CLI (in this process, torch
hidden: tests.helpers.invoke_cli); healthy gives none. `info` without torch runs the real process;
the exit codes are main()'s, in this process (a real process's exit codes 0, 1 and 2, as the shell
sees them: tests/cli/test_cli_conventions.py::test_python_m_is_the_command_itself)."""

import json

import pytest

from tests.helpers import SAMPLES, invoke_cli, run_cli

EXPECTED = json.loads((SAMPLES / "expected.json").read_text())


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_sample_trace(case, tmp_path):
    out = tmp_path / "findings.json"
    r = invoke_cli("analyze", SAMPLES / case, "--json", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    findings = json.loads(out.read_text())["findings"]
    for f in findings:
        assert set(f) >= {"kind", "severity", "step", "where", "summary", "evidence", "advice", "rank"}
        assert f["severity"] in ("error", "warning", "info")
        # one rank, or a many-rank case's (a hang where every rank stood alike names none)
        assert f["rank"] in range(len(list((SAMPLES / case).glob("rank*.h5")))) or f["kind"] == "hang"
    serious = [f for f in findings if f["severity"] in ("error", "warning")]
    exp = EXPECTED[case]
    if exp["kind"] is None:
        assert serious == [], serious
        assert "No problem found" in r.stdout
        return
    hits = [f for f in serious if f["kind"] == exp["kind"]]
    assert hits, f"{case}: expected {exp['kind']}, got {[f['kind'] for f in findings]}"
    f = hits[0]
    # Exact, except where the data is sampled (activity windows, attention every 10 steps, a
    # leak's onset fitted to a noisy line): expected.json gives the resolution.
    assert abs(f["step"] - exp["step"]) <= exp.get("step_tolerance", 0), (f["step"], exp["step"])
    if exp["where"]:  # a leak of a loss names no module: its ground truth is []
        assert set(exp["where"]) & set(f["where"]), (f["where"], exp["where"])
    if exp.get("rank") is not None:  # a many-rank case: the rank that went wrong
        assert f["rank"] == exp["rank"], (f["rank"], exp["rank"])
    assert f["evidence"] and f["advice"]
    assert exp["kind"] in r.stdout and f"step {f['step']:,}" in r.stdout


def test_fail_on_sets_exit_code(tmp_path):
    bad = SAMPLES / "nan_birth"
    assert invoke_cli("analyze", bad).returncode == 0  # default: never fail
    assert invoke_cli("analyze", bad, "--fail-on", "error").returncode == 1
    assert invoke_cli("analyze", bad, "--fail-on", "warning").returncode == 1
    assert invoke_cli("analyze", SAMPLES / "vanishing_sigmoid", "--fail-on", "error").returncode == 0
    assert invoke_cli("analyze", SAMPLES / "vanishing_sigmoid", "--fail-on", "warning").returncode == 1
    assert invoke_cli("analyze", SAMPLES / "healthy_mlp", "--fail-on", "info").returncode == 0


def test_nonfinite_names_the_birthplace_not_the_carriers(tmp_path):
    out = tmp_path / "f.json"
    invoke_cli("analyze", SAMPLES / "nan_birth", "--json", out)
    (f,) = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "nonfinite"]
    assert f["where"] == ["features.log"]
    assert f["evidence"]["stage"] == "forward"
    assert f["evidence"]["modules_with_nonfinite_output"] > 1  # later modules carried it on


def test_info_describes_the_run():
    r = run_cli("info", SAMPLES / "healthy_mlp", block_torch=True)
    assert r.returncode == 0, r.stderr
    for needle in ("rank 0 of 1", "300 (0-299)", "closed cleanly", "parameter tensors",
                   "trace schema 2", "torch 2.", " KB"):
        assert needle in r.stdout, (needle, r.stdout)
