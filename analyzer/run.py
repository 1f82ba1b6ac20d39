"""Run every detector over every rank of a trace."""

from __future__ import annotations

import traceback
from dataclasses import replace
from functools import partial

from .config import AnalysisConfig
from .code_places import with_code
from .cross_rank import CROSS_DETECTORS, counters, straggler
from .cross_rank.light import finding_steps, light, oom_steps
from .cross_rank.digest import RankDigest, digest_of, timing_of
from .cross_rank.memory import others_memory
from .cross_rank.merge import merge
from .detectors import DETECTORS
from .errors import TraceError
from .findings import Evidence, Finding, not_checked, sort_findings
from .parallel import could_not_read, per_rank
from .trace import Trace


class AnalyzerErrorEvidence(Evidence, total=False):
    detector: str  # the detector that crashed
    traceback: str  # its last frames


class UnreadableRankEvidence(Evidence, total=False):
    file: str  # the rank file that could not be read


# The evidence of the findings the runner makes itself (the detectors' are their Evidence).
RUNNER_EVIDENCE = {"analyzer_error": AnalyzerErrorEvidence, "unreadable_rank": UnreadableRankEvidence,
                   "mixed_runs": Evidence}


def analyze(trace: Trace, cfg: AnalysisConfig | None = None, workers: int = 1,
            progress=None, scheduler=None) -> list[Finding]:
    """All findings of all detectors on all ranks, one per event, most severe and earliest first.

    Each rank is read alone, in ``workers`` worker processes (parallel.py; the CLI uses one per
    CPU where the rank files are big enough to repay starting them; from a script of your own,
    under ``if __name__ == "__main__":``, as multiprocessing needs): its detectors' findings and
    its digest come back. The ranks' findings are merged, one per event with its ranks listed
    (cross_rank/merge.py); then the cross-rank detectors judge the digests together (cross_rank/). ``trace.digests`` keeps the digests for the report. With
    ``scheduler`` (a dask.distributed Client, a scheduler's address or ``local:N``) each rank is
    a task on that Dask cluster instead (cluster.py): the same findings.

    A detector that crashes does not stop the others: its crash becomes an ``error`` finding of
    kind ``analyzer_error`` that names the detector, so a bug in us is never taken for a clean run.
    Unreadable rank files become ``info`` findings. A rank restarted into the run directory is
    analyzed attempt by attempt, each file whole (trace/attempts.py): a failure in an attempt
    whose steps a later one ran again is still found, and says its attempt.
    """
    cfg = cfg or AnalysisConfig()
    findings: list[Finding] = []
    for path, reason in trace.unreadable.items():
        findings.append(could_not_read(None, path, reason))
    for kind, note in trace.notes:
        if kind == "mixed_runs":  # (a changed world size is a note only: elastic jobs do that)
            findings.append(Finding("mixed_runs", "warning", None, [], note, {},
                                    "Give each run a directory of its own; a restarted job keeps its run's."))
    counts = None
    if scheduler is None:
        results = per_rank(trace, partial(rank_pass, cfg=cfg), workers, progress)
    else:  # (the same pass, a Dask task a rank: cluster.py; the counters merged in its tree)
        from .cluster import per_rank_counted

        results, counts = per_rank_counted(trace, partial(rank_pass, cfg=cfg), scheduler, progress, cfg)
    if counts is None:  # (the local path; a run of one rank, or a tree that failed, on Dask)
        counts = _counted(trace, results, cfg)
    digests = lights(results, cfg)
    trace.digests, trace.counts = digests, (None if isinstance(counts, Exception) else counts)
    of_ranks = [f for found, _ in results.values() for f in found]
    del results  # (the local path's full digests: what follows reads the Lights and the counters only)
    merged = merge(of_ranks, trace.ranks, digests)
    findings.extend(others_memory(f, digests) for f in merged)
    for det in CROSS_DETECTORS:
        findings.extend(_guarded(det.KIND, "all ranks", lambda: det.detect(
            digests, getattr(cfg, det.KIND), trace, counts=None if det is straggler else _counts(counts))))
    return sort_findings(findings)


def _counted(trace: Trace, results: dict, cfg: AnalysisConfig):
    """The ranks' counters (cross_rank/counters.py) made here as the Dask path's tree makes them:
    from the full digests held here (the local path), or, for a rank whose Light came back
    from a Dask tree that failed, from its file read again here (its ends alone, a group of
    ranks at a time). The exception where that fails (each detector that reads them then
    fails alone, and says so)."""
    rs = sorted(r for r, (_, d) in results.items() if d is not None)
    try:
        leaves = []
        for i in range(0, len(rs), counters.LEAF):
            ds = [d if isinstance(d := results[r][1], RankDigest) else timing_of(trace.ranks[r], ends=True)
                  for r in rs[i:i + counters.LEAF]]
            leaves.append(counters.leaf(ds, cfg.hang))
        return counters.tree(leaves)
    except TraceError:
        raise
    except Exception as e:
        return e


def _counts(counts):
    """The counters, or what made them fail raised again (in the detector that needs them)."""
    if isinstance(counts, Exception):
        raise counts
    return counts


def lights(results: dict, cfg: AnalysisConfig) -> dict:
    """The ranks' Lights (cross_rank/light.py), what the cross-rank detectors and the report read:
    those the Dask path made where the ranks were read, and those of the full digests held here
    (the local path), judged here against exact per-step references. Both give the same findings."""
    full = {r: d for r, (_, d) in results.items() if isinstance(d, RankDigest)}
    verdicts = straggler.verdicts_here(full, cfg.straggler) if full else {}
    peak_steps = oom_steps(results.values())
    out = {r: d for r, (_, d) in results.items() if d is not None and not isinstance(d, RankDigest)}
    out.update({r: light(d, finding_steps(results[r][0]), peak_steps, verdicts.get(r)) for r, d in full.items()})
    return dict(sorted(out.items()))


def rank_pass(trace: Trace, rank: int, cfg: AnalysisConfig) -> tuple[list[Finding], RankDigest | None]:
    """One rank's findings (every per-rank detector, on each attempt of a restarted rank) and digest."""
    attempts = trace.attempts[rank]
    # One file: as it always was. Several: each attempt, its findings labelled.
    units = [(trace.ranks[rank], None)] if len(attempts) == 1 and attempts[0].number == 1 else \
        [(a.trace, a) for a in attempts]
    findings = []
    for rt, attempt in units:
        for det in DETECTORS:
            lacking = [name for name in det.REQUIRES if not rt.holds(name)]
            found = _not_checked(det.KIND, lacking) if lacking else \
                _guarded(det.KIND, f"rank {rank}", lambda: det.detect(rt, getattr(cfg, det.KIND)))
            findings.extend(_of_attempt(replace(with_code(f, rt), rank=rank), attempt) for f in found)
    try:
        digest = digest_of(trace.ranks[rank])
    except TraceError:
        raise
    except Exception as e:
        return findings + [_crashed("cross_rank", f"rank {rank}", e)], None
    return findings, digest


def _guarded(kind: str, on: str, run) -> list[Finding]:
    """run()'s findings; a crash (not a TraceError: unusable input stops the analysis) as one finding."""
    try:
        return run()
    except TraceError:
        raise
    except Exception as e:
        return [_crashed(kind, on, e)]


def _crashed(kind: str, on: str, e: Exception) -> Finding:
    """The analyzer_error finding of a detector that crashed (called in its except block: the traceback)."""
    return Finding("analyzer_error", "error", None, [], f"The {kind} detector failed on {on}: {type(e).__name__}: {e}",
                   {"detector": kind, "traceback": traceback.format_exc(limit=5)},
                   "This is a bug in torchautopsy; please report it with this trace.")


def checked_kinds(findings: list[Finding], n_ranks: int = 1) -> tuple[str, ...]:
    """The kinds every detector could judge: all but those that said "not checked", and those
    that need more ranks than the run has."""
    skipped = {f.kind for f in findings if not_checked(f)}
    return tuple(d.KIND for d in (*DETECTORS, *CROSS_DETECTORS)
                 if d.KIND not in skipped and n_ranks >= getattr(d, "MIN_RANKS", 1))


def not_checked_line(findings: list[Finding]) -> str | None:
    """One line for every detector that could not judge the trace, and why: the columns it lacks
    (an older recorder's trace), or what its data lacked (no gradient, no loss given), detectors of
    one reason together (the reports print it instead of a finding each)."""
    why: dict[str, list[str]] = {}
    for f in findings:
        if not_checked(f):
            reasons = why.setdefault(f.kind, [])
            said = f.evidence.get("lacking") or [f.summary.split("not checked: ", 1)[-1].rstrip(".")]
            reasons += [n for n in said if n not in reasons]
    if not why:
        return None
    kinds_of: dict[str, list[str]] = {}
    for kind, reasons in why.items():
        kinds_of.setdefault(", ".join(reasons), []).append(kind)
    return ("Not checked, as this trace does not hold what they need: "
            + "; ".join(f"{', '.join(kinds)} ({reasons})" for reasons, kinds in kinds_of.items()) + ".")


def _not_checked(kind: str, lacking: list[str]) -> list[Finding]:
    """The one finding of a detector whose data the trace lacks (an older recorder's trace)."""
    return [Finding(kind, "info", None, [], f"{kind} not checked: this trace lacks {', '.join(lacking)}.",
                    {"lacking": lacking},
                    "Record the run again with the current torchautopsy, which writes it.")]


def _of_attempt(f: Finding, attempt) -> Finding:
    """A finding in one attempt of a restarted rank says which (``attempt``, ``file`` in its
    evidence), and whether a later attempt ran its step again."""
    if attempt is None:
        return f
    where = f"Attempt {attempt.number} ({attempt.file}"
    evidence = {**f.evidence, "attempt": attempt.number, "file": attempt.file}
    if f.step is not None and f.step >= attempt.cut:
        where += f"; a later attempt resumed at step {int(attempt.cut):,} and ran this step again"
        evidence["rerun_from_step"] = int(attempt.cut)
    return replace(f, summary=f"{where}): {f.summary}", evidence=evidence)
