"""Damaged and hostile traces (issue 20): a seeded, bounded fuzzing campaign over real sample
traces, run through the real CLI and load() in a process of their own.

Each case is one mutation class with one seed (tests/hostile/mutations.py) and a few commands, run
one after another in one process (tests/hostile/run_case.py's main, in a runner forked from
tests/hostile/runner_server.py, which imported the analyzer once; tests/hostile/run_cli.py checks
the contract: exit 0 or 2, one line on exit 2, no traceback, no raw control characters, no
unescaped markup, at most 60 s and 1 GiB): one seed a class, and the cases the issue names, 28
cases. More seeds: TORCHAUTOPSY_FUZZ_SEEDS=0,1,2,3 pytest ...; the
full campaign with a table of counts: python -m tests.hostile.campaign.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest

from tests.hostile.mutations import LONG_INT, MUTATIONS, SCRIPT, kind_of, make_trial, seed_for
from tests.hostile.run_cli import close_runner_server, commands, run, run_case

SEEDS = [int(s) for s in os.environ.get("TORCHAUTOPSY_FUZZ_SEEDS", "0").split(",")]
# The cases issue 20 measured, by name (each is a seed: the seed picks a class's variant).
NAMED = [("delete", "lazy_time_s"), ("attrs", "rank#0"), ("attrs", "model_class#0"), ("attrs", "model_class#2"),
         ("links", "self_loop"), ("huge_dims", "resize_per_step"), ("memory", "n_device_traces"),
         ("memory", "long_int"), ("compression_bomb", "profile_gzip"), ("compression_bomb", "one_chunk"),
         ("many_names", "params_and_columns"), ("json_texts", f"[{LONG_INT}]")]
CASES = sorted({(cls, seed) for cls in MUTATIONS for seed in (SEEDS[:1] if cls.startswith("control") else SEEDS)}
               | {(cls, seed_for(cls, kind)) for cls, kind in NAMED}, key=lambda c: (list(MUTATIONS).index(c[0]), c[1]))
IDS = [f"{c}-{s}-{re.sub(r'[^A-Za-z0-9_#/.-]', '_', kind_of(c, s)[:20])}" for c, s in CASES]
# Classes whose damage is text a report shows: their HTML report is checked too (HTML costs
# seconds a run, so the other classes write JSON and Markdown only).
MARKUP = {"control", "hostile_names", "attrs", "json_texts", "memory"}


@pytest.fixture(scope="module", autouse=True)
def _runner_server():
    """The runners' server (run_cli.runner_server, started at the first case) closed and reaped
    with this module: its runners' CPU then counts in this process's."""
    yield
    close_runner_server()


def which(cls: str, seed: int) -> tuple[str, ...]:
    """The commands of a case: analyze, info and load() always, one export in turn (the memory
    snapshot one where the trace has snapshots), HTML for the text classes, PDF for one case."""
    w = ["analyze", "info", "load", ("profile", "params")[seed % 2], "memory"]
    if cls in MARKUP:
        w.append("html")
    if (cls, kind_of(cls, seed)) in {("hostile_names", "names"), ("attrs", "model_class#0")}:
        w.append("pdf")  # the PDF of hostile names, and of a 100,000-character model class
    return tuple(w)


def report(trial, runs) -> str:
    """What failed, and how to reproduce it: the mutation, the seed, the command."""
    # Each command's line reproduces it alone; the case ran them in one process, in this order.
    lines = [f"{trial.label}", f"  (one process, in order: {', '.join(r.label for r in runs)})"]
    for r in runs:
        if r.violations:
            cmd = r.command().replace(str(trial.run_dir), "RUN").replace(str(trial.run_dir.parent / "out"), "OUT")
            lines += [f"  $ python -m tests.hostile.mutations {trial.cls} {trial.seed} RUN && {cmd}",
                      f"    rc={r.rc} {r.wall_s:.1f} s {r.peak_rss / 2**20:.0f} MiB: {'; '.join(r.violations)}",
                      *(f"    | {line}"[:300] for line in r.tail(6).splitlines())]
    return "\n".join(lines)


@pytest.mark.parametrize("cls, seed", CASES, ids=IDS)
def test_hostile_trace(tmp_path, cls, seed):
    trial = make_trial(cls, seed, tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    try:
        runs = run_case(commands(trial.run_dir, out, trial.has_memory, which(cls, seed)), out)
    finally:
        shutil.rmtree(trial.run_dir)  # some classes write 100+ MB; the seed rebuilds them
    bad = [r for r in runs if r.violations]
    assert not bad, "\n" + report(trial, runs)
    if cls.startswith("control"):  # the harness itself: an untouched trace analyzes fine
        assert all(r.rc == 0 for r in runs), report(trial, runs)


def test_checker_catches_what_it_must(tmp_path):
    """A checker that flags nothing would pass every case: show it flags each kind of violation."""
    md, html = tmp_path / "r.md", tmp_path / "r.html"
    md.write_text("name \x1b]8;;http://evil\x1b\\x | <img src=x>\n")
    html.write_text(f"<td>{SCRIPT}</td>")
    code = "import sys; print('\\x9b'); sys.stderr.write('a\\nb\\n'); sys.exit(2)"
    r = run("selftest", [sys.executable, "-c", code], tmp_path, {"md": md, "html": html})
    kinds = sorted({v.split(":")[0] for v in r.violations})
    assert kinds == ["control_chars", "markup", "stderr_lines"], r.violations
    r = run("selftest", [sys.executable, "-c", "raise ValueError('x')"], tmp_path)
    assert sorted(v.split(":")[0] for v in r.violations) == ["exit_code", "traceback"]
    r = run("selftest", [sys.executable, "-c", "pass"], tmp_path, {"json": tmp_path / "never.json"})
    assert [v.split(":")[0] for v in r.violations] == ["missing_output"]
    r = run("selftest", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path, timeout=1)
    assert r.violations and r.violations[0].startswith("timeout") and r.wall_s < 10
    r = run("selftest", [sys.executable, "-c", "b = b'x' * (1200 << 20)"], tmp_path)
    assert any(v.startswith("memory") for v in r.violations), (r.peak_rss, r.violations)
