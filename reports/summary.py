"""What every report says first: the facts of the run and the verdict. Plain text, no markup.

The renderers (HTML, PDF, Markdown) take these strings and escape them for their own format.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..analyzer.cross_rank.merge import rank_set
from ..analyzer.findings import STAGES, Finding, first_to_go_wrong, not_checked
from ..analyzer.restarts import restart_lines
from ..analyzer.run import checked_kinds, not_checked_line
from ..analyzer.trace import RankTrace, Trace
from .format import format_bytes, format_duration, plural
from .model import Fact, Span, Text, Verdict
from .sections import section
from .sections._text import text

# The detectors every report says it ran, in registry order.
PROBLEM_SEVERITIES = ("error", "warning")
CLEAN_END = "closed cleanly"
# The verdict names the first problem and at most this many after it (grouped by kind).
MAX_CHAIN = 5

__all__ = ["CLEAN_END", "build_verdict", "ending", "first_fix", "format_bytes", "format_duration",
           "plural", "recorder_settings", "run_facts", "run_line", "steps_span"]


def build_verdict(findings: list[Finding], n_ranks: int = 1,
                  anchors: dict[int, str] | None = None) -> Verdict:
    """The headline and the chain: the first warning or error in time, then what followed it.

    Findings of one kind are told once, at their first step (three dead layers are one link of
    the chain). Problems without a step (an unreadable rank, a detector that crashed) come last.
    ``anchors`` maps id(finding) to its place in the report, for a link to the first one.
    """
    problems = [f for f in findings if f.severity in PROBLEM_SEVERITIES]
    notes = sum(f.severity not in PROBLEM_SEVERITIES and not not_checked(f) for f in findings)
    lacking = not_checked_line(findings) or ""
    if not problems:
        return Verdict("ok", "No problem found", (), checked_kinds(findings, n_ranks), 0, notes, None,
                       not_checked=lacking)
    worst = "error" if any(f.severity == "error" for f in problems) else "warning"
    counts = [plural(sum(f.severity == s for f in problems), s) for s in PROBLEM_SEVERITIES
              if any(f.severity == s for f in problems)]
    first = first_to_go_wrong(problems)
    dated = sorted((f for f in problems if f.step is not None), key=_when)
    groups: dict[tuple[str, int | None], list[Finding]] = {}
    for f in dated:
        groups.setdefault((f.kind, f.rank if n_ranks > 1 else None), []).append(f)
    chain = list(groups.values())
    sentences: list[Text] = []
    if chain:
        links = [_link(fs, n_ranks) for fs in chain[: MAX_CHAIN + 1]]
        sentences.append(_capitalize(text(links[0], ".")))
        if len(links) > 1:
            then: list = ["Then "]
            for i, link in enumerate(links[1:]):
                then += ["; " if i else "", link]
            left = len(chain) - len(links)
            then.append(f"; and {plural(left, 'more problem')} below." if left > 0 else ".")
            sentences.append(text(*then))
    undated = [f for f in problems if f.step is None]
    for f in undated[:2]:
        sentences.append(text(f"{'Also: ' if chain else ''}{f.summary}"))
    if len(undated) > 2:
        sentences.append(text(f"And {plural(len(undated) - 2, 'more problem')} without a step below."))
    head_f = first or problems[0]
    at = f" at step {head_f.step:,}" if head_f.step is not None else ""
    on = f" on rank {head_f.rank}" if n_ranks > 1 and head_f.rank is not None else ""
    headline = f"{', '.join(counts)}; first to go wrong: {head_f.kind}{at}{on}"
    anchor = (anchors or {}).get(id(head_f))
    return Verdict(worst, headline, tuple(sentences), checked_kinds(findings, n_ranks), len(problems), notes, anchor,
                   fix=first_fix(head_f.advice), not_checked=lacking)


_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")


def first_fix(advice: str) -> str:
    """The advice's first sentence: the one thing to try first, for the verdict. A sentence ends
    at . ! or ? before a space or the end, never inside parentheses or after an abbreviation
    ("a collective that only some ranks call (e.g. under a condition)" is one sentence)."""
    text, depth = advice.strip(), 0
    for i, c in enumerate(text):
        depth += (c in "([") - (c in ")]") if depth or c in "([" else 0
        if c in ".!?" and depth <= 0 and (i + 1 == len(text) or text[i + 1].isspace()) \
                and not text[:i + 1].lower().endswith(_ABBREVIATIONS):
            return text[:i + 1]
    return text


def _when(f: Finding):
    stage = f.evidence.get("stage") if isinstance(f.evidence, dict) else None
    return (f.step, STAGES.index(stage) if stage in STAGES else len(STAGES), f.rank or 0)


def _link(fs: list[Finding], n_ranks: int) -> Text:
    link = section(fs[0].kind).phrase(fs)
    if n_ranks > 1 and fs[0].rank is not None:
        link = text(link, f" on rank {fs[0].rank}")
    return link


def _capitalize(t: Text) -> Text:
    if not t or not t[0].text or t[0].code:
        return t
    s = t[0]
    return (Span(s.text[0].upper() + s.text[1:], s.code), *t[1:])


# -- the header -----------------------------------------------------------------------------------
def run_line(trace: Trace, endings: bool = True) -> str:
    """The run in one line: model, parameters, steps, ranks, how it ended; the optimizer and its
    learning rate. ``Sequential (5,313 parameters), 100 steps (0-99), 1 rank, 0.4 s; Adam, lr
    0.001; closed cleanly``. Without ``endings``, ranks that ended in different ways are left to
    run_facts' lines (one per way)."""
    ranks = list(trace.ranks.values())
    first = ranks[0]
    meta = first.meta
    steps = steps_span(first) if len({r.n_steps for r in ranks}) == 1 else _steps(ranks)
    parts = [f"{meta.get('model_class', 'unknown')} ({int(meta.get('n_parameters', 0)):,} parameters), {steps}, "
             f"{plural(len(ranks), 'rank')}, {format_duration(max(r.wall_time_s for r in ranks))}"]
    opt = optimizer_line(first)
    if opt:
        parts.append(opt)
    groups = ending_groups(ranks)
    if endings or len(groups) == 1:
        parts.append("; ".join(reason if len(groups) == 1 else f"{reason} on {who}" for reason, who in groups))
    if trace.unreadable:
        parts.append(f"{plural(len(trace.unreadable), 'rank file')} unreadable")
    return "; ".join(parts)


def optimizer_line(rt: RankTrace) -> str:
    """``Adam, lr 0.001`` or ``AdamW, lr 1e-05 to 0.0003``: the first optimizer and the range of its
    learning rate; "" when the trace has neither."""
    names = [str(c) for c in rt.optimizers["class"]] if len(rt.optimizers) else []
    lr = rt.columns["lr"].to_numpy(dtype=np.float64) if rt.n_steps else np.zeros(0)
    lr = lr[np.isfinite(lr)]
    rate = ""
    if lr.size:
        lo, hi = float(lr.min()), float(lr.max())
        rate = f"lr {lo:.3g}" if math.isclose(lo, hi, rel_tol=1e-9) else f"lr {lo:.3g} to {hi:.3g}"
    opt = " + ".join(dict.fromkeys(names))
    return ", ".join(p for p in (opt, rate) if p)


def run_facts(trace: Trace) -> list[Fact]:
    """The run summary of a report's header, one line each."""
    ranks = list(trace.ranks.values())
    first = ranks[0]
    meta = first.meta
    facts = [
        Fact("Run directory", trace.run_dir),
        Fact("Model", str(meta.get("model_class", "unknown"))),
        Fact("Parameters", f"{int(meta.get('n_parameters', 0)):,} in {len(first.param_names):,} tensors; "
                           f"{len(first.module_names):,} modules"),
        Fact("Ranks", _ranks(trace)),
        Fact("Steps", _steps(ranks)),
        Fact("Wall time", format_duration(max(r.wall_time_s for r in ranks))),
        Fact("Started", str(meta.get("start_time", "unknown"))),
        Fact("Host", _distinct(ranks, "host") + f" ({_distinct(ranks, 'device')})"),
        Fact("Torch", _distinct(ranks, "torch_version")),
        Fact("Trace size", f"{format_bytes(trace.size_bytes)} in {trace.n_files} file(s), written by "
                           f"{_distinct(ranks, 'created_by')}"),
    ]
    groups = ending_groups(ranks)
    # One line per way the ranks ended; a single way is in the run line of the first screen already.
    facts.extend(Fact("Ended", reason if len(groups) == 1 else f"{who}: {reason}", bad=reason != CLEAN_END,
                      first_screen=len(groups) > 1) for reason, who in groups)
    facts.extend(Fact("Restart", line) for line in restart_lines(trace))  # a file per attempt
    dropped = sum(int(r.meta.get("dropped_steps", r.meta.get("dropped_rows", 0)) or 0) for r in ranks)
    if dropped:
        facts.append(Fact("Dropped steps", f"{dropped} (the recorder's queue was full; those steps "
                                           "are missing)", bad=True))
    for path, reason in trace.unreadable.items():
        facts.append(Fact("Unreadable", f"{path}: {reason}", bad=True))
    return facts


def recorder_settings(trace: Trace) -> list[tuple[str, str]]:
    """The Recorder's options as the trace holds them (rank 0's; ranks share their settings)."""
    cfg = next(iter(trace.ranks.values())).meta.get("config", {})
    if not isinstance(cfg, dict):
        return []
    return [(str(k), str(v)) for k, v in sorted(cfg.items())]


def ending_groups(ranks: list[RankTrace]) -> list[tuple[str, str]]:
    """How the ranks' recordings ended: (reason, its ranks) for each distinct reason, in rank
    order: ``("closed on SIGTERM (pre-empted or cancelled)", "rank 2")``."""
    by_reason: dict[str, list[int]] = {}
    for r in ranks:
        by_reason.setdefault(ending(r), []).append(r.rank)
    every = [r.rank for r in ranks]
    return [(reason, rank_set(rs, every)) for reason, rs in sorted(by_reason.items(), key=lambda kv: min(kv[1]))]


# A library's own source place at the head of its error message ("[/__w/pytorch/pytorch/third_party/
# gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out ..."): where in gloo, not what happened.
_SOURCE_PLACE = re.compile(r"\[[^\]\s]*[/\\][^\]\s]*:\d+\]\s*")


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
        return f"closed by an exception in the training loop ({_SOURCE_PLACE.sub('', reason.partition(': ')[2])})"
    return reason  # e.g. "recorder error: ..." when recording stopped early


def steps_span(rt: RankTrace) -> str:
    """``"30 steps (0-29)"``: how many steps one rank recorded, and which."""
    if rt.n_steps == 0:
        return "no steps"
    idx = rt.step_index
    return f"{plural(rt.n_steps, 'step')} ({int(idx[0]):,}-{int(idx[-1]):,})"


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
