"""Run every detector over every rank of a trace."""

from __future__ import annotations

import traceback
from dataclasses import replace

from .config import AnalysisConfig
from .detectors import DETECTORS
from .errors import TraceError
from .findings import Evidence, Finding, not_checked, sort_findings
from .trace import Trace


class AnalyzerErrorEvidence(Evidence, total=False):
    detector: str  # the detector that crashed
    traceback: str  # its last frames


class UnreadableRankEvidence(Evidence, total=False):
    file: str  # the rank file that could not be read


# The evidence of the findings the runner makes itself (the detectors' are their Evidence).
RUNNER_EVIDENCE = {"analyzer_error": AnalyzerErrorEvidence, "unreadable_rank": UnreadableRankEvidence,
                   "mixed_runs": Evidence}


def analyze(trace: Trace, cfg: AnalysisConfig | None = None) -> list[Finding]:
    """All findings of all detectors on all ranks, most severe and earliest first.

    A detector that crashes does not stop the others: its crash becomes an ``error`` finding of
    kind ``analyzer_error`` that names the detector, so a bug in us is never taken for a clean run.
    Unreadable rank files become ``info`` findings. A rank restarted into the run directory is
    analyzed attempt by attempt, each file whole (trace/attempts.py): a failure in an attempt
    whose steps a later one ran again is still found, and says its attempt.
    """
    cfg = cfg or AnalysisConfig()
    findings: list[Finding] = []
    for path, reason in trace.unreadable.items():
        findings.append(Finding("unreadable_rank", "warning", None, [], reason, {"file": path},
                                "Copy that rank's file again from the job's run directory."))
    for kind, note in trace.notes:
        if kind == "mixed_runs":  # (a changed world size is a note only: elastic jobs do that)
            findings.append(Finding("mixed_runs", "warning", None, [], note, {},
                                    "Give each run a directory of its own; a restarted job keeps its run's."))
    for rank, attempts in trace.attempts.items():
        # One file: as it always was. Several: each attempt, its findings labelled.
        units = [(trace.ranks[rank], None)] if len(attempts) == 1 and attempts[0].number == 1 else \
            [(a.trace, a) for a in attempts]
        for rt, attempt in units:
            for det in DETECTORS:
                try:
                    lacking = [name for name in det.REQUIRES if rt.lacks(name)]
                    found = _not_checked(det.KIND, lacking) if lacking else det.detect(rt, getattr(cfg, det.KIND))
                except TraceError:
                    raise
                except Exception as e:
                    found = [Finding(
                        "analyzer_error", "error", None, [],
                        f"The {det.KIND} detector failed on rank {rank}: {type(e).__name__}: {e}",
                        {"detector": det.KIND, "traceback": traceback.format_exc(limit=5)},
                        "This is a bug in torchautopsy; please report it with this trace.",
                    )]
                findings.extend(_of_attempt(replace(f, rank=rank), attempt) for f in found)
    return sort_findings(findings)


def checked_kinds(findings: list[Finding]) -> tuple[str, ...]:
    """The kinds every detector could judge: all but those that said "not checked"."""
    skipped = {f.kind for f in findings if not_checked(f)}
    return tuple(d.KIND for d in DETECTORS if d.KIND not in skipped)


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
