"""diff: two runs of one recipe, A (the reference, the run that worked) and B (the suspect):
what differs in their setup (setup.py), where and when B's trajectory parts from A's
(trajectories.py), and the findings one has and the other has not.

    from torchautopsy import load
    from torchautopsy.analyzer.diff import diff_runs
    result = diff_runs(load("runs/main"), load("runs/change"))
    result.to_dict()  # the `diff --json` document (README, docs/diff.md)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import TraceError
from ..findings import Finding
from ..trace import RankTrace, Trace
from .setup import setup_differences
from .trajectories import (EXACT_TOLERANCE, Parting, common_steps, exact_regime, first_difference, loss_parting,
                           statistical_parting)

__all__ = ["DiffResult", "diff_runs", "new_findings", "pick_rank"]


@dataclass
class DiffResult:
    a: RankTrace
    b: RankTrace
    identical: bool
    parted: Parting | None
    loss_parted: Parting | None  # where the loss itself parted, when the first parting is elsewhere
    first_difference: Parting | None  # the first value that differs at all (same seed and data only)
    common_steps: int
    setup: list[dict]
    new_findings: dict = field(default_factory=lambda: {"a": [], "b": []})

    def to_dict(self) -> dict:
        p = self.parted
        parted = None if p is None else {"step": p.step, "where": list(p.where), "what": _what(p),
                                         "ratio": _finite(p.ratio)}
        return {"identical": self.identical, "parted": parted, "setup": [dict(s) for s in self.setup],
                "new_findings": {k: [f.to_dict() for f in v] for k, v in self.new_findings.items()}}

    def verdict(self) -> str:
        """One sentence: whether and where B parts from A, then the first setup differences."""
        return self._trajectory() + self._setup_words() + "."

    def _trajectory(self) -> str:
        n = f"{self.common_steps:,} step(s) both recorded"
        if self.identical:
            return f"B is identical to A, to the bit, over the {n}"
        if self.parted is None:
            tail = ""
            if self.first_difference is not None:
                tail = (f" (they differ by rounding from step {self.first_difference.step:,}, first in "
                        f"the {self.first_difference.what})")
            return f"B is the same as A within their noise over the {n}{tail}"
        p = self.parted
        text = f"B parts from A at step {p.step:,}, first in the {_what(p)}"
        lp = self.loss_parted
        if lp is not None and lp.step > p.step:
            text += f", {lp.step - p.step:,} step(s) before its loss"
        elif lp is None and p.what != "loss":
            text += "; the loss stays within noise"
        return text

    def _setup_words(self) -> str:
        """The first setup differences, as "; setup: lr 0.001 → 0.002" (the setup table lists all)."""
        if not self.setup:
            return ""
        shown = [f"{s['name']} {_short(s['a'])} → {_short(s['b'])}" for s in self.setup[:SETUP_IN_VERDICT]]
        more = len(self.setup) - len(shown)
        return "; setup: " + ", ".join(shown) + (f" and {more:,} more" if more > 0 else "")


SETUP_IN_VERDICT = 3  # setup differences the verdict names
_SETUP_VALUE_CHARS = 40


def _short(v) -> str:
    text = "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    return text if len(text) <= _SETUP_VALUE_CHARS else text[:_SETUP_VALUE_CHARS - 1] + "…"


def _finite(x: float):
    return x if x == x and abs(x) != float("inf") else None


def _what(p: Parting) -> str:
    how = "" if p.what == "learning rate" else f" ({p.ratio:.3g}x A's)" if p.ratio == p.ratio else ""
    if p.what == "learning rate":
        how = f" ({p.a:.4g} → {p.b:.4g})"
    return f"{p.what}{how}" + (" (bitwise)" if p.exact and abs(p.ratio - 1) < EXACT_TOLERANCE else "")


def pick_rank(a: Trace, b: Trace, rank: int | None) -> tuple[RankTrace, RankTrace]:
    """The rank compared: ``rank``, or the only one; runs of several ranks need --rank."""
    if rank is None:
        if len(a.ranks) != len(b.ranks):
            raise TraceError(f"A has {len(a.ranks):,} rank(s) and B {len(b.ranks):,}: give --rank R to compare one rank")
        if len(a.ranks) != 1:
            rank = min(set(a.ranks) & set(b.ranks), default=None)
            if rank is None:
                raise TraceError("A and B share no rank number: give --rank R")
        else:
            return next(iter(a.ranks.values())), next(iter(b.ranks.values()))
    for name, t in (("A", a), ("B", b)):
        if rank not in t.ranks:
            raise TraceError(f"{name} has no rank {rank} (it has {', '.join(map(str, sorted(t.ranks))) or 'none'})")
    return a.ranks[rank], b.ranks[rank]


def diff_runs(a: Trace, b: Trace, rank: int | None = None, findings: tuple[list, list] | None = None) -> DiffResult:
    """Compare B with A (one rank of each; see pick_rank). ``findings``: each run's findings
    (analyze's), for those one has and the other has not."""
    ra, rb = pick_rank(a, b, rank)
    with ra.held(), rb.held():  # (one open of each file for the comparison's ~500 reads)
        steps, _, _ = common_steps(ra, rb)
        if not len(steps):
            raise TraceError("A and B share no step number: nothing to compare")
        first = first_difference(ra, rb) if exact_regime(ra, rb) else None
        identical = first is None and exact_regime(ra, rb)
        if first is not None and abs(first.ratio - 1) >= EXACT_TOLERANCE:
            parted = first
        else:
            parted = None if identical else statistical_parting(ra, rb)
        loss_parted = None
        if parted is not None and parted.what != "loss":
            loss_parted = loss_parting(ra, rb, exact=parted.exact)
        result = DiffResult(ra, rb, identical, parted, loss_parted, first, len(steps), setup_differences(ra, rb))
    if findings is not None:
        result.new_findings = new_findings(*findings)
    return result


def new_findings(fa: list[Finding], fb: list[Finding]) -> dict:
    """Findings (warning or error) of a kind the other run has none of."""
    def kinds(fs):
        return {f.kind for f in fs if f.severity in ("warning", "error")}
    ka, kb = kinds(fa), kinds(fb)
    return {"a": [f for f in fa if f.severity in ("warning", "error") and f.kind not in kb],
            "b": [f for f in fb if f.severity in ("warning", "error") and f.kind not in ka]}
