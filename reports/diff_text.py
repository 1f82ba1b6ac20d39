"""`diff`'s terminal lines and its Markdown report: the verdict, the setup differences (A -> B),
and the findings one run has and the other has not. Names from the traces are made printable on
the terminal and escaped in Markdown, as the analyzer's own reports do."""

from __future__ import annotations

import shlex

from ..analyzer.diff import DiffResult
from ..analyzer.display import NAME_CHARS, printable, shorten_words
from .markdown import md_text

SETUP_ROWS = 30  # setup differences listed; the rest counted
FINDINGS_SHOWN = 10  # new findings listed per run


def _value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _finding_line(f) -> str:
    at = f" at step {f.step:,}" if f.step is not None else ""
    where = f" in {', '.join(f.where[:2])}" if f.where else ""
    return f"{f.severity} {f.kind}{at}{where}"


def diff_lines(r: DiffResult, a_dir: str, b_dir: str) -> list[str]:
    lines = [f"A (reference): {printable(a_dir)}  [rank {r.a.rank}, {r.a.n_steps:,} steps]",
             f"B (suspect):   {printable(b_dir)}  [rank {r.b.rank}, {r.b.n_steps:,} steps]", "",
             shorten_words(r.verdict(), NAME_CHARS, 2000), ""]
    if r.setup:
        lines.append(f"Setup differences ({len(r.setup)}), A → B:")
        for s in r.setup[:SETUP_ROWS]:
            lines.append(f"  {shorten_words(s['name'], NAME_CHARS, 200)}: "
                         f"{shorten_words(_value(s['a']), NAME_CHARS, 200)} → {shorten_words(_value(s['b']), NAME_CHARS, 200)}")
        if len(r.setup) > SETUP_ROWS:
            lines.append(f"  ... and {len(r.setup) - SETUP_ROWS} more (--json lists them all)")
    else:
        lines.append("Setup: no difference recorded.")
    for key, label in (("b", "New in B"), ("a", "Only in A")):
        found = r.new_findings.get(key, [])
        if found:
            lines += ["", f"{label}:"] + [f"  {shorten_words(_finding_line(f), NAME_CHARS, 300)}"
                                           for f in found[:FINDINGS_SHOWN]]
    return lines


def render_diff_markdown(r: DiffResult, a_dir: str, b_dir: str) -> str:
    lines = [f"# torchautopsy diff: {md_text(b_dir, 200)} against {md_text(a_dir, 200)}", "",
             f"**A (reference):** {md_text(a_dir, 200)}, rank {r.a.rank}, {r.a.n_steps:,} steps; "
             f"**B (suspect):** {md_text(b_dir, 200)}, rank {r.b.rank}, {r.b.n_steps:,} steps", "",
             f"**Verdict:** {md_text(r.verdict(), 700, NAME_CHARS)}", ""]
    if r.setup:
        lines += ["| setup | A | B |", "| --- | --- | --- |"]
        for s in r.setup[:SETUP_ROWS]:
            lines.append(f"| {md_text(s['name'], 100, NAME_CHARS)} | {md_text(_value(s['a']), 100, NAME_CHARS)} | "
                         f"{md_text(_value(s['b']), 100, NAME_CHARS)} |")
        if len(r.setup) > SETUP_ROWS:
            lines.append(f"\n{len(r.setup) - SETUP_ROWS} more differences: `diff --json` lists them all.")
    else:
        lines.append("Setup: no difference recorded.")
    for key, label in (("b", "New in B"), ("a", "Only in A")):
        found = r.new_findings.get(key, [])
        if found:
            lines += ["", f"**{label}:**", ""] + [f"- {md_text(_finding_line(f), 300, NAME_CHARS)}"
                                                  for f in found[:FINDINGS_SHOWN]]
    command = f"torchautopsy diff {shlex.quote(printable(a_dir))} {shlex.quote(printable(b_dir))}"
    lines += ["", "Reproduce:", "", "```", command.replace("`", "'"), "```"]
    return "\n".join(lines) + "\n"
