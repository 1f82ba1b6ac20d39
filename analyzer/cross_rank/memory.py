"""Out of memory on a many-rank run: the rank that ran out first, and how far the others were."""

from __future__ import annotations

from dataclasses import replace

from ..findings import Finding
from .light import peak_by


def others_memory(f: Finding, digests: dict) -> Finding:
    """An out_of_memory finding of one rank, told how close the other ranks came by its step:
    their peak memory as a share of its own (the same measure: the CUDA allocator's peak where
    measured, else resident memory)."""
    if f.kind != "out_of_memory" or f.rank not in digests or len(digests) < 2 or f.step is None:
        return f
    peak = {r: _peak(d, f.step) for r, d in digests.items()}
    own = peak[f.rank]
    others = {r: p for r, p in peak.items() if r != f.rank and p is not None}
    if not own or not others:
        return f
    shares = {r: p / own for r, p in others.items()}
    lo, hi = min(shares.values()), max(shares.values())
    closest = max(shares, key=shares.get)
    kind = digests[f.rank].memory_kind
    what = "CUDA peak" if kind == "cuda_peak" else "resident memory"
    note = (f" By step {f.step:,} the other ranks' {what} peaked at {100 * lo:.0f}-{100 * hi:.0f}% of rank "
            f"{f.rank}'s (closest: rank {closest}).")
    evidence = {**f.evidence, "others_memory": {"measure": kind, "min_share": lo, "max_share": hi,
                                                 "closest_rank": closest}}
    return replace(f, summary=f.summary + note, evidence=evidence)


def _peak(d, step: int) -> float | None:
    """Its peak memory up to ``step``: asked of it where its series are (light.py), or from them."""
    peaks = getattr(d, "peaks", None)
    return peaks.get(step) if peaks is not None else peak_by(d, step)
