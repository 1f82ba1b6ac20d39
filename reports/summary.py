"""What every report says first: the facts of the run and the verdict. Plain text, no markup.

Both renderers (HTML, Markdown) take these strings and escape them for their own format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..analyzer.detectors import DETECTORS
from ..analyzer.findings import Finding
from ..analyzer.trace import RankTrace, Trace

# The detectors every report says it ran, in registry order.
CHECKED = tuple(det.KIND for det in DETECTORS)
PROBLEM_SEVERITIES = ("error", "warning")
CLEAN_END = "closed cleanly"


@dataclass(frozen=True)
class Fact:
    label: str
    value: str
    bad: bool = False  # a fact the reader should not miss (a killed job, unreadable ranks)


@dataclass(frozen=True)
class Verdict:
    problem: Finding | None  # the first (most severe, earliest) warning or error, if any
    n_problems: int          # how many findings are warnings or errors
    n_notes: int             # how many are info
    checked: tuple[str, ...] = CHECKED


def verdict(findings: list[Finding]) -> Verdict:
    """The headline of a report; ``findings`` come sorted (severity, step) from the analyzer."""
    problems = [f for f in findings if f.severity in PROBLEM_SEVERITIES]
    return Verdict(problems[0] if problems else None, len(problems), len(findings) - len(problems))


def run_facts(trace: Trace) -> list[Fact]:
    """The run summary of a report's header, one line each."""
    ranks = list(trace.ranks.values())
    first = ranks[0]
    meta = first.meta
    facts = [
        Fact("Run directory", trace.run_dir),
        Fact("Model", str(meta.get("model_class", "unknown"))),
        Fact("Parameters", f"{int(meta.get('n_parameters', 0)):,} in {len(first.param_names)} tensors"),
        Fact("Ranks", _ranks(trace)),
        Fact("Steps", _steps(ranks)),
        Fact("Wall time", format_duration(max(r.wall_time_s for r in ranks))),
        Fact("Started", str(meta.get("start_time", "unknown"))),
        Fact("Host", _distinct(ranks, "host")),
        Fact("Torch", _distinct(ranks, "torch_version")),
        Fact("Trace size", f"{format_bytes(trace.size_bytes)} in {len(ranks)} file(s)"),
    ]
    endings = {r.rank: ending(r) for r in ranks}
    facts.append(Fact("Ended", _per_rank(endings), bad=set(endings.values()) != {CLEAN_END}))
    dropped = sum(int(r.meta.get("dropped_rows", 0) or 0) for r in ranks)
    if dropped:
        facts.append(Fact("Dropped rows", f"{dropped} (the recorder's queue was full; those steps "
                                          "are missing)", bad=True))
    for path, reason in trace.unreadable.items():
        facts.append(Fact("Unreadable", f"{path}: {reason}", bad=True))
    return facts


def ending(rt: RankTrace) -> str:
    """How the recording of one rank ended, in words."""
    if not rt.closed_cleanly:
        return ("not closed: the job was killed (SIGKILL, out of memory) or is still running; "
                "steps up to the last flush were read")
    reason = str(rt.meta.get("end_reason", "closed"))
    if reason == "closed":
        return CLEAN_END
    if reason == "exit":
        return "closed at interpreter exit (rec.close() was not called)"
    if reason == "sigterm":
        return "closed on SIGTERM (pre-empted or cancelled)"
    if reason.startswith("exception"):
        return f"closed by an exception in the training loop ({reason.partition(': ')[2]})"
    return reason  # e.g. "recorder error: ..." when recording stopped early


def steps_span(rt: RankTrace) -> str:
    """``"30 steps (0-29)"``: how many steps one rank recorded, and which."""
    if rt.n_steps == 0:
        return "no steps"
    idx = rt.step_index
    return f"{plural(rt.n_steps, 'step')} ({int(idx[0])}-{int(idx[-1])})"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def format_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def format_duration(s: float) -> str:
    if not math.isfinite(s):
        return "unknown"
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s"


def _ranks(trace: Trace) -> str:
    ids = list(trace.ranks)
    world = max(int(r.meta.get("world_size", 1)) for r in trace.ranks.values())
    names = f"rank {ids[0]}" if len(ids) == 1 else f"ranks {', '.join(map(str, ids))}"
    return f"{len(ids)} of world size {world} ({names})"


def _steps(ranks: list[RankTrace]) -> str:
    return _per_rank({r.rank: steps_span(r) for r in ranks})


def _distinct(ranks: list[RankTrace], key: str) -> str:
    values = sorted({str(r.meta.get(key, "unknown")) for r in ranks})
    return ", ".join(values)


def _per_rank(by_rank: dict[int, str]) -> str:
    """One value when all ranks agree, else ``rank N: value`` for each."""
    if len(set(by_rank.values())) == 1:
        return next(iter(by_rank.values()))
    return "; ".join(f"rank {r}: {v}" for r, v in by_rank.items())
