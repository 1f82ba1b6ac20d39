"""What ``torchautopsy analyze`` and ``torchautopsy info`` print: the run, each finding, the verdict,
the black box, and the description of a run directory, as lines of plain text.

Like markdown.py it takes the trace and the findings; the CLI echoes each line as it comes (a
trace read lazily may still fail halfway, after what was printed). Every name and string from the
trace is cut and stripped of control characters (display.py): a trace may hold anything. A
``Style`` (terminal_style.py) colours the severities and the verdict and wraps the lines at word
boundaries on a terminal; the default, ``PLAIN``, gives plain, unwrapped lines (piped output).

Imported by the CLI on every ``analyze`` and ``info``, so it imports nothing that pulls in
matplotlib, jinja or fpdf2: not reports.summary, whose verdict chain needs reports.sections; the
terminal's verdict (no problem found, the counts, the rank that went wrong first) is read from the
same analyzer functions that summary.py uses.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterator

import numpy as np

from ..analyzer.display import NAME_CHARS, TITLE_CHARS, printable, shorten, shorten_words
from ..analyzer.errors import TraceError
from ..analyzer.export import describe_stored, fired_blackbox
from ..analyzer.cross_rank.merge import rank_set
from ..analyzer.findings import SEVERITIES, Finding, first_to_go_wrong, not_checked
from ..analyzer.restarts import attempt_lines, blackbox_lines, restart_lines
from ..analyzer.run import checked_kinds, not_checked_line
from ..analyzer.series import spacing
from ..analyzer.trace import Trace
from .terminal_style import PLAIN, Style

# A finding's summary on the terminal is cut to this many characters.
SUMMARY_CHARS = 1000
# A line of ``info`` (or a restart line of ``analyze``) that holds text from the trace is cut to
# this many characters.
INFO_TEXT_CHARS = 600
_PROBLEMS = ("error", "warning")


def human_bytes(n: float) -> str:
    """``512 B``, ``2.4 MB``: sizes on disk, in 1024s."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _text(s) -> str:
    """A line or detail holding text from the trace, with long names cut in their middle."""
    return shorten_words(s, NAME_CHARS, INFO_TEXT_CHARS)


# -- analyze --------------------------------------------------------------------------------------
def analyze_lines(trace: Trace, findings: list[Finding], style: Style = PLAIN) -> Iterator[str]:
    """The terminal report of ``analyze``: the run, its restarts and unclosed ranks, the verdict,
    a line pair per finding (as the analyzer sorted them), the counts and the black box."""
    wrap = style.wrap
    yield wrap(f"torchautopsy: {printable(trace.run_dir)}: {run_line(trace)}")
    for line in restart_lines(trace):  # a job restarted into the directory (restarts.py)
        yield wrap(f"  {_text(line)}")
    unclosed: dict[int, list[int]] = {}  # steps flushed -> the ranks that did not close their traces
    for rt in trace.ranks.values():
        if not rt.closed_cleanly:
            unclosed.setdefault(rt.n_steps, []).append(rt.rank)
    for n, ranks in sorted(unclosed.items()):
        who = rank_set(ranks, list(trace.ranks))
        yield wrap(f"  note: {who} did not close {'its trace' if len(ranks) == 1 else 'their traces'} (job killed?); "
                   f"analyzed the {n:,} steps {'it' if len(ranks) == 1 else 'each'} flushed")
    if not any(f.severity in _PROBLEMS for f in findings):
        yield style.verdict(wrap(f"No problem found (checked: {', '.join(checked_kinds(findings, len(trace.ranks)))})."))
    lacking = not_checked_line(findings)
    if lacking:
        yield wrap(f"  {lacking}")
    findings = [f for f in findings if not not_checked(f)]  # (that line says it once)
    for f in findings:
        yield finding_line(f, style)
    first = first_to_go_wrong(findings)
    ranks_hit = {r for f in findings if f.severity in _PROBLEMS
                 for r in [f.rank, *(f.evidence.get("ranks") or [] if isinstance(f.evidence, dict) else [])]}
    if first is not None and len(trace.ranks) > 1 and len(ranks_hit) > 1:
        yield style.verdict(wrap(f"rank {first.rank} went wrong first: {first.kind} at step {first.step:,}"
                                 + (f" ({first.evidence['stage']})" if "stage" in first.evidence else "")),
                            first.severity)
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    if findings:
        worst = next(s for s in SEVERITIES if counts[s])
        yield style.verdict(wrap(", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)),
                            worst)
    box = blackbox_line(trace, first.rank if first is not None else None)
    if box:
        yield _wrap_command(style, box)
    for line in blackbox_lines(trace):  # of attempts before a rank's last
        yield _wrap_command(style, line)


_COMMAND = "take it out with: "


def _wrap_command(style: Style, line: str) -> str:
    """A line that ends in a command to run, wrapped: the command on a line of its own, whole (a
    command copied from wrapped lines would run in pieces; a terminal folds a long one softly)."""
    if style.width is None or len(line) <= style.width or _COMMAND not in line:
        return style.wrap(line)
    prose, command = line.split(_COMMAND, 1)
    return f"{style.wrap(prose + _COMMAND.rstrip())}\n    {command}"


def run_line(trace: Trace) -> str:
    """``Sequential (161 parameters), 2 ranks, 30 steps, 0.7 s``"""
    rt0 = next(iter(trace.ranks.values()))
    steps = max(r.n_steps for r in trace.ranks.values())
    n_ranks = len(trace.ranks)
    return (f"{shorten(rt0.meta.get('model_class', '?'), TITLE_CHARS)} "
            f"({rt0.meta.get('n_parameters', 0):,} parameters), "
            f"{n_ranks} rank{'s' if n_ranks != 1 else ''}, {steps:,} steps, "
            f"{rt0.wall_time_s:.1f} s")


def finding_line(f: Finding, style: Style = PLAIN) -> str:
    """Two lines (more where ``style`` wraps them): severity, kind, rank, step and where; then the summary."""
    # Names come from the trace: each cut (the JSON findings hold them whole), and so is the summary.
    where = ", ".join(shorten(w or "(model)") for w in f.where[:3]) or "-"
    step = f"step {f.step:,}" if f.step is not None else "-"
    rank = f"rank {f.rank}" if f.rank is not None else ""
    severity = f.severity.upper()
    head = style.wrap(f"  {severity:8} {f.kind:22} {rank:7} {step:12} {where}", hang=11)
    head = "  " + style.severity(f.severity, severity) + head[2 + len(severity):]  # wrapped before colouring
    summary = style.wrap(f"      {shorten_words(f.summary, NAME_CHARS, SUMMARY_CHARS)}", hang=6)
    return f"{head}\n{summary}"


def blackbox_line(trace: Trace, prefer: int | None = None) -> str:
    """Where a black box fired (rank ``prefer``'s if it did), and the command that takes the moment
    it broke out; or ""."""
    fired = fired_blackbox(trace, prefer)
    if not fired:
        return ""
    rt, row, rank = fired
    when = "before its bad update" if row["params_at"] == "start_of_step" else "after its update"
    return (f"black box: rank {rt.rank} kept step {int(row['step']):,} ({shorten(row['trigger'], NAME_CHARS)}), "
            f"parameters {when}; take it out with: torchautopsy export {shlex.quote(printable(trace.run_dir))}{rank} --params blackbox "
            "params.safetensors --tensors blackbox inputs.safetensors")


# -- info -----------------------------------------------------------------------------------------
_STORED_LABELS = {"Parameter snapshots": "snapshots", "Sampled activations and gradients": "samples",
                  "Black box": "black box"}


def info_lines(trace: Trace, style: Style = PLAIN) -> Iterator[str]:
    """What ``info`` prints: the run directory, then each rank (a paragraph, after a blank line),
    then the unreadable files and the notes on files that do not fit the run."""
    for line in _info_lines(trace):
        yield style.wrap(line)


def _info_lines(trace: Trace) -> Iterator[str]:
    yield f"run directory  {printable(trace.run_dir)}"
    yield f"size on disk   {human_bytes(trace.size_bytes)} in {trace.n_files} file(s)"
    for rt in trace.ranks.values():
        with held(rt):  # (one open of the file for the paragraph's ~80 reads)
            yield from _rank_lines(trace, rt)
        for t in [rt, *(a.trace for a in getattr(rt, "attempts", ()))]:
            if hasattr(t, "release"):
                t.release()  # (what the paragraph read: memory stays flat over thousands of ranks)
    for _, reason in trace.unreadable.items():
        yield f"\nunreadable     {shorten_words(reason, width=INFO_TEXT_CHARS)}"
    for _, note in trace.notes:
        yield f"\nnote           {shorten_words(note, NAME_CHARS, INFO_TEXT_CHARS)}"


def held(rt) -> contextlib.ExitStack:
    """A rank's files (each attempt's, for a restarted rank) kept open while the context lasts."""
    stack = contextlib.ExitStack()
    for t in [rt, *(a.trace for a in getattr(rt, "attempts", ()))]:
        try:
            stack.enter_context(t.held())
        except (AttributeError, TraceError):  # (not a file, or gone: each read opens it and says why)
            pass
    return stack


def _rank_lines(trace: Trace, rt) -> Iterator[str]:
    # Every string of the trace's metadata is cut for the terminal (a trace may hold anything).
    m = rt.meta
    steps = rt.step_index
    span = f"{steps[0]:,}-{steps[-1]:,}" if len(steps) else "none"
    try:
        act, upd = rt.sample_steps("activations"), rt.sample_steps("updates")
    except TraceError:
        act = upd = np.zeros(0, np.int64)
    state = "closed cleanly" if rt.closed_cleanly else "not closed (job killed or still running)"
    yield (f"\nrank {rt.rank} of {shorten(m.get('world_size', 1))}   {os.path.basename(rt.path)}, "
           f"{human_bytes(rt.size_bytes)}, {state}"
           + (f", end: {_text(m['end_reason'])}" if m.get("end_reason") else ""))
    yield f"  steps        {rt.n_steps:,} ({span}), {rt.wall_time_s:.1f} s from {shorten(m.get('start_time', '?'))}"
    for line in attempt_lines(trace, rt.rank):  # a restarted rank: its attempts, one timeline
        yield f"  {_text(line)}"
    yield f"  model        {shorten(m.get('model_class', '?'), TITLE_CHARS)}, {m.get('n_parameters', 0):,} parameters"
    census = rt.columns["live_tensors"].to_numpy() if rt.n_steps else np.zeros(0)
    yield (f"  recorded     every step: loss, lr, time split, memory, gradient and weight norms of "
           f"{len(rt.param_names)} parameter tensors; on {len(act)} watched steps{_every(act)}: the outputs "
           f"of {len(rt.module_names)} modules and their statistics; update ratios at {len(upd)} "
           f"steps{_every(upd)}; a census of live tensors at {int((census >= 0).sum())} steps")
    pw = rt.profile_windows
    if len(pw):
        spans = ", ".join(f"{int(a)}-{int(b)}" for a, b in zip(pw["step_start"][:8], pw["step_end"][:8]))
        yield (f"  profiler     {len(pw)} window(s) at steps {spans}{' ...' if len(pw) > 8 else ''} "
               f"(torchautopsy export RUN_DIR --profile OUT.json --window N)")
    if isinstance(m.get("profile_note"), str):  # windows deferred, skipped or lost (several Recorders)
        yield f"  {_text('profiler note: ' + m['profile_note'])}"
    shards = int((rt.param_shards > 1).sum())
    if shards:
        yield (f"  sharded      {shards} parameter tensor(s) split across ranks (FSDP2): this file holds "
               f"rank {rt.rank}'s shards; analyze combines the ranks")
    snaps = rt.memory_snapshots
    if len(snaps):
        at = ", ".join(f"{int(x):,}" for x in snaps["step"][:8])
        yield (f"  CUDA memory  {len(snaps)} allocator snapshot(s) at steps {at}{' ...' if len(snaps) > 8 else ''} "
               f"(torchautopsy export RUN_DIR --memory-snapshot OUT.pickle --which N)")
    ooms = rt.oom_events
    if len(ooms):
        yield (f"  out of memory  {len(ooms)} event(s), first at step {int(ooms['step'].iloc[0]):,} "
               f"on {shorten(ooms['device'].iloc[0])}")
    try:
        for what, _, detail in describe_stored(rt):
            yield f"  {_STORED_LABELS.get(what, 'histograms'):12} {_text(detail)}"
    except TraceError as e:
        yield f"  tensors      unreadable ({shorten_words(e, width=INFO_TEXT_CHARS)})"
    if m.get("dropped_steps"):
        yield f"  dropped      {shorten(m['dropped_steps'])} steps (the writer fell behind)"
    yield f"  host         {shorten(m.get('host', '?'))}, device {shorten(m.get('device', '?'))}"
    yield (f"  versions     trace schema {shorten(m.get('schema_version'))}, "
           f"{shorten(m.get('created_by', '?'))}, torch {shorten(m.get('torch_version', '?'))}, "
           f"python {shorten(m.get('python_version', '?'))}")


def _every(steps) -> str:
    """' (every N)' or ' (every N-M)' steps between samples, or ''."""
    every = spacing(steps)
    return f" (every {every})" if every else ""
