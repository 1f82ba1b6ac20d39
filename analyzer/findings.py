"""The one result type of the analyzer: data only, serialisable to the JSON of DESIGN.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SEVERITIES = ("error", "warning", "info")
_RANK = {s: i for i, s in enumerate(SEVERITIES)}


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


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first, then earliest step (no step last), then rank."""
    return sorted(findings, key=lambda f: (_RANK[f.severity], f.step is None, f.step or 0, f.rank or 0))


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
