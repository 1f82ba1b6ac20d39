"""The Markdown report: short enough for a ticket, one finding per table row, names escaped."""

from __future__ import annotations

from reports_testlib import HOSTILE_IMG, HOSTILE_SCRIPT

from torchautopsy.analyzer.findings import Finding, first_to_go_wrong
from torchautopsy.analyzer.run import analyze
from torchautopsy.reports import render_markdown
from torchautopsy.reports.markdown import MAX_ROWS

TABLE_HEADER = "| severity | kind | rank | step | where | summary |"


def table_rows(md: str) -> list[str]:
    lines = md.splitlines()
    start = lines.index(TABLE_HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        rows.append(line)
    return rows


def cells(row: str) -> list[str]:
    """The cells of a table row, splitting on unescaped pipes."""
    parts, cur, i = [], "", 1
    while i < len(row) - 1:
        if row[i] == "\\":
            cur += row[i:i + 2]
            i += 2
            continue
        if row[i] == "|":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += row[i]
        i += 1
    return parts + [cur.strip()]


def test_diverged_run_lists_its_findings(diverged):
    findings = analyze(diverged)
    md = render_markdown(diverged, findings)
    lines = md.splitlines()
    assert len(lines) <= 40
    assert lines[0] == f"# torchautopsy report: {diverged.run_dir}"
    assert "Sequential (1,377 parameters), 30 steps (0-29), 1 rank" in md
    first = first_to_go_wrong(findings)
    verdict = next(line for line in lines if line.startswith("**Verdict:** "))
    assert f"; first to go wrong: {first.kind} at step {first.step}. " in verdict
    rows = table_rows(md)
    assert len(rows) == len(findings)
    for row, f in zip(rows, findings):  # most severe first, then by step
        assert cells(row)[:4] == [f.severity, f.kind, str(f.rank), str(f.step)]
    assert f"torchautopsy analyze {diverged.run_dir} --html report.html --pdf report.pdf" in md


def test_healthy_run_says_no_problem(healthy):
    md = render_markdown(healthy, analyze(healthy))
    from torchautopsy.analyzer.detectors import DETECTORS

    checked = ", ".join([d.KIND for d in DETECTORS] + ["hang"])  # (one rank: no straggler, no replicas)
    assert f"**Verdict:** No problem found (checked: {checked})." in md
    assert len(md.splitlines()) <= 40


def test_many_findings_stay_under_forty_lines_and_cells_stay_one_line(healthy):
    findings = [Finding("exploding_gradients", "warning", s, [f"layers.{s}.weight"] * 9,
                        f"step {s}: a | b\nc " + "x" * 500, {}, "", rank=0) for s in range(50)]
    md = render_markdown(healthy, findings)
    assert len(md.splitlines()) <= 40
    rows = table_rows(md)
    assert len(rows) == MAX_ROWS
    assert f"{50 - MAX_ROWS} more finding(s)" in md
    first = cells(rows[0])
    assert len(first) == 6
    assert first[5].startswith(r"step 0: a \| b c xxx") and first[5].endswith("…")
    assert len(first[5]) <= 161 and len(first[4]) <= 60


def test_names_from_the_trace_are_escaped(hostile):
    findings = [Finding("nonfinite", "error", 1, [HOSTILE_SCRIPT, f"{HOSTILE_IMG}.weight"],
                        f"NaN born in {HOSTILE_SCRIPT}", {}, "", rank=0)]
    md = render_markdown(hostile, findings)
    assert HOSTILE_SCRIPT not in md and HOSTILE_IMG not in md
    assert r"\<script\>alert(1)\</script\>" in md
    assert r"Net\<script\>alert(1)\</script\>" in md  # the model class, in the run line
    assert len(cells(table_rows(md)[0])) == 6


def test_killed_job_is_said(killed):
    md = render_markdown(killed, analyze(killed))
    assert "not closed: the job was killed" in md
