"""Run every detector over every rank of a trace."""

from __future__ import annotations

import traceback

from .config import AnalysisConfig
from .detectors import DETECTORS
from .errors import TraceError
from .findings import Finding, sort_findings
from .trace import Trace


def analyze(trace: Trace, cfg: AnalysisConfig | None = None) -> list[Finding]:
    """All findings of all detectors on all ranks, most severe and earliest first.

    A detector that crashes does not stop the others: its crash becomes an ``error`` finding of
    kind ``analyzer_error`` that names the detector, so a bug in us is never taken for a clean run.
    Unreadable rank files become ``info`` findings.
    """
    cfg = cfg or AnalysisConfig()
    findings: list[Finding] = []
    for path, reason in trace.unreadable.items():
        findings.append(Finding("unreadable_rank", "warning", None, [], reason, {"file": path},
                                "Copy that rank's file again from the job's run directory."))
    for rank, rt in trace.ranks.items():
        for det in DETECTORS:
            try:
                found = det.detect(rt, getattr(cfg, det.KIND))
            except TraceError:
                raise
            except Exception as e:
                found = [Finding(
                    "analyzer_error", "error", None, [],
                    f"The {det.KIND} detector failed on rank {rank}: {type(e).__name__}: {e}",
                    {"detector": det.KIND, "traceback": traceback.format_exc(limit=5)},
                    "This is a bug in torchautopsy; please report it with this trace.",
                )]
            findings.extend(_with_rank(f, rank) for f in found)
    return sort_findings(findings)


def _with_rank(f: Finding, rank: int) -> Finding:
    from dataclasses import replace

    return replace(f, rank=rank)
