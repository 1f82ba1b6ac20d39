"""One finding per event, not one per rank: the ranks' findings of the same kind, severity and
place merged, with the ranks listed ("on ranks 0-63 except 5") and the first rank named.

A rank's own findings of one kind and place are kept apart by their order on that rank (its
first such finding merges with the others' first, its second with their second), so that two
events on one rank never become one. The merged finding is the first rank's: the earliest by
step, then by stage within the step (a NaN in rank 1's batch comes before the NaN every rank's
gradients hold after the all-reduce), then by rank."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..findings import Finding, STAGES
from .local import local_first

MAX_LISTED = 8  # ranks named one by one before they are written as ranges


def rank_set(ranks, all_ranks) -> str:
    """"all 64 ranks", "ranks 0-63 except 5", "ranks 1, 3-5", "rank 2"."""
    ranks, all_ranks = sorted(set(ranks)), sorted(set(all_ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == all_ranks:
        return "both ranks" if len(ranks) == 2 else f"all {len(ranks):,} ranks"
    plain = f"ranks {_ranges(ranks)}"
    missing = sorted(set(all_ranks) - set(ranks))
    # "ranks 0-63 except 5" where the gaps are fewer pieces than the ranks themselves
    if 0 < len(missing) <= MAX_LISTED and _ranges(missing).count(",") < _ranges(ranks).count(",") \
            and "," not in _ranges(all_ranks):
        return f"ranks {_ranges(all_ranks)} except {_ranges(missing)}"
    return plain


def _ranges(xs: list[int]) -> str:
    out, start, prev = [], None, None
    for x in xs + [None]:
        if start is not None and (x is None or x != prev + 1):
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if x is not None and start is None:
            start = x
        prev = x
    return ", ".join(out)


def _stage(f: Finding) -> int:
    stage = f.evidence.get("stage") if isinstance(f.evidence, dict) else None
    return STAGES.index(stage) if stage in STAGES else len(STAGES)


def merge(findings: list[Finding], all_ranks, digests: dict | None = None) -> list[Finding]:
    """The findings of all ranks (each with its ``rank``), one per event. With the ranks' digests,
    ranks tied for first are told apart by what is local to each (local.py)."""
    all_ranks = sorted(set(all_ranks))
    if len(all_ranks) < 2:
        return findings
    groups: dict[tuple, list[Finding]] = defaultdict(list)
    seen: dict[tuple, int] = defaultdict(int)
    for f in sorted(findings, key=lambda f: (f.step is None, f.step or 0, _stage(f))):
        attempt = f.evidence.get("attempt") if isinstance(f.evidence, dict) else None
        place = (f.kind, f.severity, tuple(f.where), attempt)
        nth = seen[(place, f.rank)]
        seen[(place, f.rank)] += 1
        groups[(place, nth)].append(f)
    return [_one(group, all_ranks, digests or {}) for group in groups.values()]


def _one(group: list[Finding], all_ranks: list[int], digests: dict) -> Finding:
    key = lambda f: (f.step is None, f.step or 0, _stage(f))  # noqa: E731
    first = min(group, key=lambda f: (*key(f), f.rank if f.rank is not None else -1))
    ranks = sorted({f.rank for f in group if f.rank is not None})
    if len(ranks) < 2:
        return first
    evidence = {**first.evidence, "ranks": ranks}
    tied = [f for f in group if key(f) == key(first)]
    if len(tied) > 1 and first.step is not None:
        local = local_first([f.rank for f in tied], first.step, digests)
        if local is not None:
            first = next(f for f in tied if f.rank == local[0])
            evidence = {**first.evidence, "ranks": ranks, "local_first": local[1]}
    steps = {f.rank: f.step for f in group}
    if len(set(steps.values())) > 1:
        evidence["step_by_rank"] = {str(r): s for r, s in sorted(steps.items())}
    where = rank_set(ranks, all_ranks)
    summary = f"{first.summary} [{where}; rank {first.rank} first]" if first.step is not None else \
        f"{first.summary} [{where}]"
    return replace(first, summary=summary, evidence=evidence)
