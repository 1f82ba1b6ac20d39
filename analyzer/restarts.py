"""A restarted job in words and in the figures' terms: one line per restart for ``info``,
``analyze`` and the reports' header, each attempt of a rank for ``info``, where black boxes of
earlier attempts are, the overview's restart markers and the loss of steps run again.

Names here are the run directory's file names (rank{N}[.attemptK].h5, matched by the reader) and
numbers; nothing a trace says is printed unshortened.
"""

from __future__ import annotations

import os
import shlex

from .display import NAME_CHARS, shorten
from .errors import TraceError
from .trace.attempts import Attempt, restarts
from .trace.rank import RankTrace


def _ended(rt: RankTrace) -> str:
    if not rt.closed_cleanly:
        return "not closed (killed?)"
    return shorten(rt.meta.get("end_reason", "closed"), 60)


def restart_line(rank: int, a: Attempt, prev: Attempt | None) -> str:
    """``rank 0 restarted at step 50 (attempt 2, file rank0.attempt2.h5): attempt 1 ...``"""
    at = f"step {a.first:,}" if a.first is not None else "an unknown step (it recorded none)"
    text = f"rank {rank} restarted at {at} (attempt {a.number}, file {a.file})"
    if prev is None:
        return text + f"; the file of attempt {a.number - 1} is missing or unreadable"
    reached = f"reached step {prev.last:,}" if prev.last is not None else "recorded no step"
    text += f": attempt {prev.number} ({prev.file}) {reached}, {_ended(prev.trace)}"
    if not prev.joined:
        return text + "; it recorded another model (another run's file)"
    rerun = prev.rerun
    if rerun is not None and a.first is not None and a.first <= rerun[0]:
        lo, hi = rerun
        text += f"; its steps {lo:,}-{hi:,} were run again" if hi > lo else f"; its step {lo:,} was run again"
        if a.first == 0:
            text += " (started over at step 0: a job resuming a checkpoint passes Recorder(..., start_step=N))"
    return text


def restart_lines(trace) -> list[str]:
    """A line per restart, then the notes on files that do not fit one run."""
    return [restart_line(*r) for r in restarts(trace)] + [note for _, note in trace.notes]


def attempt_lines(trace, rank: int) -> list[str]:
    """For ``info``: each attempt of a restarted rank (its file, steps, ending), then its restarts."""
    attempts = trace.attempts.get(rank, [])
    if len(attempts) < 2 and all(a.number == 1 for a in attempts):
        return []
    lines = []
    for a in attempts:
        span = f"steps {a.first:,}-{a.last:,}" if a.first is not None else "no steps"
        if not a.joined:
            kept = "another run: not in the timeline"
        elif a.kept == a.trace.n_steps:
            kept = "all in the timeline"
        else:
            kept = f"{a.kept:,} in the timeline, {a.trace.n_steps - a.kept:,} run again by a later attempt"
        lines.append(f"attempt {a.number:<3} {a.file}: {span} ({kept}), {_ended(a.trace)}")
    lines += [restart_line(*r) for r in restarts(trace) if r[0] == rank]
    return lines + [f"(below: what {attempts[-1].file} holds; torchautopsy info RUN_DIR/FILE for another attempt's)"]


def blackbox_lines(trace) -> list[str]:
    """Black boxes that fired in attempts other than a rank's last (``analyze`` names the
    last's): where they are, and the command that takes one out of its attempt's file."""
    out = []
    for rank, attempts in trace.attempts.items():
        for a in attempts[:-1]:
            try:
                bb = a.trace.blackbox
            except TraceError:
                continue
            if len(bb):
                row = bb.iloc[0]
                path = shlex.quote(os.path.join(trace.run_dir, a.file))
                out.append(f"black box: rank {rank}, attempt {a.number} ({a.file}) kept step {int(row['step']):,} "
                           f"({shorten(row['trigger'], NAME_CHARS)}); take it out with: torchautopsy export {path} "
                           "--params blackbox params.safetensors --tensors blackbox inputs.safetensors")
    return out


def restart_marks(trace) -> list[tuple[int, str, str]]:
    """(step, "restart", label): a vertical line at each restart, for the overview's figures."""
    multi = len(trace.ranks) > 1
    return [(a.first, "restart", f"restart: attempt {a.number}" + (f", rank {rank}" if multi else ""))
            for rank, a, _ in restarts(trace) if a.first is not None and a.joined]


def rerun_losses(trace) -> dict:
    """The loss of the steps a later attempt ran again, per attempt: the branch the job left
    (often where it went wrong), drawn beside the timeline's loss."""
    out = {}
    multi = len(trace.ranks) > 1
    for rank, attempts in trace.attempts.items():
        for a in attempts:
            if a.joined and a.rerun is not None:
                label = f"attempt {a.number}, steps run again" + (f" (rank {rank})" if multi else "")
                out[label] = a.trace.columns["loss"].iloc[a.kept:]
    return out


def attempt_view(trace, finding):
    """The trace with the finding's rank read from the finding's own attempt (its evidence's
    ``attempt``), for its figure: the evidence was found there. ``trace`` itself otherwise."""
    from .trace import Trace

    attempts = trace.attempts.get(finding.rank, [])
    number = finding.evidence.get("attempt") if isinstance(finding.evidence, dict) else None
    chosen = [a for a in attempts if a.number == number]
    if len(attempts) < 2 or not chosen or chosen[0].trace is trace.ranks.get(finding.rank):
        return trace
    return Trace(trace.run_dir, {**trace.ranks, finding.rank: chosen[0].trace}, trace.unreadable,
                 trace.attempts, trace.notes)
