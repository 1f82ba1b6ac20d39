"""A Markdown report short enough to paste into a ticket (at most ~40 lines).

Names from the trace are escaped (a module called ``<img onerror=...>`` stays text in a tracker
that renders HTML inside Markdown) and table cells are kept to one short line.
"""

from __future__ import annotations

import re
import shlex

from ..analyzer.display import NAME_CHARS, printable, shorten, shorten_words
from ..analyzer.export import fired_blackbox
from ..analyzer.findings import Finding, first_to_go_wrong, not_checked
from ..analyzer.restarts import restart_lines
from ..analyzer.run import not_checked_line
from ..analyzer.trace import Trace
from .model import plain
from .summary import build_verdict, run_line

# 18 fixed lines, at most MAX_ROWS table rows (and 2 saying more are left out), 2 for the black
# box: 40 lines at most.
MAX_ROWS = 18
_CELL_CHARS = {"kind": 28, "where": 60, "summary": 160}
_WHERE_NAMES = 3  # names listed in the "where" cell, each cut to NAME_CHARS / 2
_VERDICT_CHARS = 700
# CommonMark lets any ASCII punctuation be backslash-escaped; these would otherwise make markup
# (code spans, emphasis, strikethrough, links and autolinks, HTML tags, table cells, entities,
# headings, GitHub's $math$). "_" between two letters or digits never makes emphasis: left as it
# is (down_proj).
_SPECIAL = re.compile(r"([\\`*~\[\]<>|&#$]|(?<![^\W_])_|_(?![^\W_]))")


def render_markdown(trace: Trace, findings: list[Finding]) -> str:
    """The ticket-sized report of ``trace`` and its ``findings`` (sorted as the analyzer returns them)."""
    restarts = [f"- {md_text(line, 400, NAME_CHARS)}" for line in restart_lines(trace)]  # a file per attempt
    lines = [f"# torchautopsy report: {md_text(trace.run_dir, 200)}", "", _run_line(trace), "",
             *(["**Restarts:**", "", *restarts, ""] if restarts else []), _verdict_line(findings, len(trace.ranks)), ""]
    lacking = not_checked_line(findings)
    if lacking:
        lines += [md_text(lacking, _VERDICT_CHARS, NAME_CHARS), ""]
    findings = [f for f in findings if not not_checked(f)]  # (that line says it once)
    lines += _findings_table(findings) if findings else ["No findings."]
    first = first_to_go_wrong(findings)
    box = _blackbox_line(trace, first.rank if first is not None else None)
    if box:
        lines += ["", box]
    command = f"torchautopsy analyze {shlex.quote(printable(trace.run_dir))} --html report.html --pdf report.pdf"
    fence = "`" * max(3, _longest_backtick_run(command) + 1)
    lines += ["", "Full report with evidence and figures (reproduce the analysis):", "", fence, command, fence]
    return "\n".join(lines) + "\n"


def md_text(text: str, width: int, word: int | None = None) -> str:
    """``text`` on one line, cut to ``width`` characters (and first each unbroken run longer than
    ``word``, a name in a sentence, in its middle), with Markdown's special characters escaped."""
    text = " ".join(shorten_words(text, word or 4 * width, 4 * width).split())
    if len(text) > width:
        text = text[: width - 1] + "…"
    return _SPECIAL.sub(r"\\\1", text)


def _run_line(trace: Trace) -> str:
    return "**Run:** " + md_text(run_line(trace), 400, NAME_CHARS)


def _verdict_line(findings: list[Finding], n_ranks: int) -> str:
    """The verdict and, when something went wrong, what to do first (the first finding's advice)."""
    v = build_verdict(findings, n_ranks)
    if v.severity == "ok":
        return f"**Verdict:** No problem found (checked: {', '.join(v.checked)})."
    chain = " ".join(plain(s) for s in v.sentences)
    line = f"**Verdict:** {md_text(v.headline, 200, NAME_CHARS)}. {md_text(chain, _VERDICT_CHARS, NAME_CHARS)}"
    return line + (f"\n\n**Fix first:** {md_text(v.fix, _VERDICT_CHARS, NAME_CHARS)}" if v.fix else "")


def _findings_table(findings: list[Finding]) -> list[str]:
    rows = ["| severity | kind | rank | step | where | summary |", "| --- | --- | --- | --- | --- | --- |"]
    for f in findings[:MAX_ROWS]:
        cells = [
            f.severity,
            md_text(f.kind, _CELL_CHARS["kind"]),
            "" if f.rank is None else str(f.rank),
            "" if f.step is None else str(f.step),
            md_text(", ".join(shorten(w or "(model)", NAME_CHARS // 2) for w in f.where[:_WHERE_NAMES])
                    + (f" and {len(f.where) - _WHERE_NAMES} more" if len(f.where) > _WHERE_NAMES else ""),
                    _CELL_CHARS["where"]),
            md_text(f.summary, _CELL_CHARS["summary"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    if len(findings) > MAX_ROWS:
        rows += ["", f"_{len(findings) - MAX_ROWS} more finding(s) in the HTML or JSON report._"]
    return rows


def _blackbox_line(trace: Trace, prefer: int | None) -> str:
    """One line when a rank's black box fired (rank ``prefer``'s if it did): where, and the command
    that takes it out."""
    fired = fired_blackbox(trace, prefer)
    if not fired:
        return ""
    rt, row, rank = fired
    when = "before the bad update" if row["params_at"] == "start_of_step" else "after the step's update"
    # The run's own directory, so that the command pastes as it is (a placeholder if a backtick or a
    # line break would break the code span).
    run = shlex.quote(printable(trace.run_dir))
    if "`" in run or "\n" in run or len(run) > 200:
        run = "RUN_DIR"
    return (f"**Black box:** rank {rt.rank}, step {int(row['step']):,} ({md_text(row['trigger'], 40)}): "
            f"parameters {when} and that step's inputs are in the trace; "
            f"`torchautopsy export {run}{rank} --params blackbox params.safetensors --tensors blackbox "
            f"inputs.safetensors`")


def _longest_backtick_run(text: str) -> int:
    return max((len(m) for m in re.findall(r"`+", text)), default=0)
