"""The one result type of the analyzer: data only, serialisable to the JSON of ``analyze --json``
(docs/architecture.md; each kind's keys: its detector's Evidence)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypedDict

SEVERITIES = ("error", "warning", "info")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


class Evidence(TypedDict, total=False):
    """The keys any finding's evidence may carry. Each detector declares its own keys in a
    subclass named ``Evidence`` (its JSON contract); reports read only declared keys, and
    tests/analyzer/test_evidence_contract.py holds both sides to it."""

    stage: str  # where in the step it arose: one of STAGES
    lacking: list  # a "not checked" finding: the datasets the trace lacks (run.py)
    attempt: int  # a restarted rank: the attempt the finding is in (run.py)
    file: str  # ... and that attempt's file
    rerun_from_step: int  # ... and the step a later attempt resumed at, if it ran this one again
    ranks: list  # a many-rank run: every rank that showed it, the finding being the first's (cross_rank/merge.py)
    step_by_rank: dict  # ... and the step each showed it at, where they differ
    local_first: str  # ... why the rank named went first when all showed it at once (cross_rank/local.py)
    others_memory: dict  # out of memory on one rank: how far the others were (cross_rank/memory.py)
    code: dict  # where to look: each module or parameter named -> its code's "Class, file:line" (code_places.py)


def evidence_keys(evidence_type) -> frozenset[str]:
    """The keys an Evidence TypedDict declares, its bases' included."""
    return frozenset(evidence_type.__annotations__) | frozenset(Evidence.__annotations__)


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: str  # "error" | "warning" | "info"
    step: int | None  # first step it shows (0-based, as rec.step() counts), or None
    where: list[str]  # module/parameter names as named_modules()/named_parameters() spell them
    summary: str
    evidence: dict = field(default_factory=dict)
    advice: str = ""
    rank: int | None = None

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "step": self.step,
            "where": list(self.where),
            "rank": self.rank,
            "summary": self.summary,
            "evidence": _jsonable(self.evidence),
            "advice": self.advice,
        }

    def at_least(self, level: str) -> bool:
        return _RANK[self.severity] <= _RANK[level]


# Within one step, where a fault can arise, in the order the step runs them.
STAGES = ("batch", "forward", "loss", "loss_backward", "backward", "optimizer")


# Kinds that are the consequences of another problem when both start on the same step: a network
# that cannot train (gradients exploding or vanishing, updates far too large) shows a loss that
# never moves, saturated or dead units, collapsed attention. Listed after the cause on that step.
_SYMPTOMS = ("loss_plateau", "saturation", "attention_collapse", "dead_relu")


def _symptom(f: Finding) -> bool:
    ev = f.evidence if isinstance(f.evidence, dict) else {}
    return f.kind in _SYMPTOMS or (f.kind == "initial_loss" and ev.get("cause") == "never_moved")


def _order(f: Finding):
    stage = f.evidence.get("stage") if isinstance(f.evidence, dict) else None
    stage_i = STAGES.index(stage) if stage in STAGES else len(STAGES)
    return (f.step is None, f.step or 0, stage_i, _symptom(f), f.rank or 0)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; then earliest step (no step last), stage within the step, rank."""
    return sorted(findings, key=lambda f: (_RANK[f.severity], *_order(f)))


def not_checked(f: Finding) -> bool:
    """A detector's one finding saying it could not judge this trace (it lacks the data)."""
    return f.severity == "info" and f.summary.startswith(f"{f.kind} not checked")


def first_to_go_wrong(findings: list[Finding]) -> Finding | None:
    """The earliest warning or error in time (step, then stage within the step), any rank."""
    serious = [f for f in findings if f.severity in ("error", "warning") and f.step is not None]
    return min(serious, key=_order) if serious else None


def _jsonable(x):
    """Numbers as plain JSON: numpy scalars to Python, NaN/Inf to strings (JSON has neither)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x
