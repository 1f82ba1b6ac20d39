"""straggler (warning): one rank's steps take longer than the others', from some step on, and in
which phase.

Under data parallelism the ranks meet in the gradient all-reduce, so a slow rank makes every
rank's step as slow as its own: total step time does not tell it. What does is where each rank
spends the step: the straggler spends its extra time in its own work (waiting for its data,
between steps, its forward), the others spend the same time waiting in the collective, inside
their backward. Per step, each rank's own work is compared with the median rank's; a rank whose
excess is at least `min_excess_share` of the median step (and `min_excess_s`) on most steps of a
window of `window` steps is a straggler from the first slow step of that window.

A rank whose backward itself is slow (a slow GPU's kernels) cannot be told this way: every rank
leaves the all-reduce together; host timing cannot say who was late (benchmarks/README.md)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..trace.phases import SPENT_IN
from .aligned import common_steps, matrix

OWN_PHASES = ("data", "between_steps", "forward")


@dataclass(frozen=True)
class StragglerConfig:
    # Excess of a rank's own work over the median rank's, as a share of the median step: 20% of
    # a step is far above the jitter of the ranks' host timing on one machine (the healthy
    # torchrun runs of tests/integrations: under 5% of a step at the 95th percentile; measured).
    min_excess_share: float = 0.2
    min_excess_s: float = 0.005
    # Slow on at least `min_share` of `window` consecutive steps: a straggler, not a hiccup.
    window: int = 20
    min_share: float = 0.5
    min_slow_steps: int = 5


class Evidence(FindingEvidence, total=False):
    phase: str  # the rank's own phase that grew most: data | between_steps | forward
    excess_s: float  # median excess of its own work over the median rank's, on its slow steps (s)
    median_step_s: float  # the median rank's step time over the same steps (s)
    slow_steps: int  # its slow steps from the first on
    last_slow_step: int
    others_wait_s: float  # how much longer the other ranks' backward took on those steps (median, s): their wait


KIND = "straggler"
CONFIG = StragglerConfig
MIN_RANKS = 2  # (what it compares: ranks)
ORDER = 10


def detect(digests, cfg: StragglerConfig, trace=None) -> list[Finding]:
    if len(digests) < 2:
        return []
    with warnings.catch_warnings():  # (medians of steps no rank timed: NaN, said nothing of)
        warnings.simplefilter("ignore", RuntimeWarning)
        return _detect(digests, cfg)


def _detect(digests, cfg: StragglerConfig) -> list[Finding]:
    steps = common_steps(digests)
    if len(steps) < cfg.min_slow_steps:
        return []
    ranks = sorted(digests)
    excess, slow, med_step, phase_med = _per_step(digests, steps, cfg)
    findings = []
    w = max(1, min(cfg.window, len(steps)))
    kernel = np.ones(w)
    for i, r in enumerate(ranks):
        if slow[i].sum() < cfg.min_slow_steps:
            continue
        share = np.convolve(slow[i], kernel, mode="valid") / w  # share of slow steps in each window
        windows = np.flatnonzero(share >= cfg.min_share)
        if not len(windows):
            continue
        # The onset: the first slow step that begins a sustained run (min_slow_steps slow in a row)
        # -- not an early hiccup such as DDP's bucket rebuild in the second step's forward.
        run = np.convolve(slow[i], np.ones(cfg.min_slow_steps), mode="valid") >= cfg.min_slow_steps
        sustained = np.flatnonzero(run[windows[0]:]) + windows[0] if len(run) > windows[0] else np.zeros(0, int)
        start = int(sustained[0]) if len(sustained) else windows[0] + int(np.argmax(slow[i, windows[0]:windows[0] + w]))
        mask = slow[i].copy()
        mask[:start] = False
        own = {p: matrix({r: digests[r]}, lambda d, p=p: d.phases[p], steps)[0] for p in OWN_PHASES}
        phase_excess = {p: np.nanmedian(own[p][mask] - phase_med[p][mask]) for p in OWN_PHASES}
        phase = max(phase_excess, key=lambda p: phase_excess[p])
        others = {q: d for q, d in digests.items() if q != r}
        before = ~mask & (np.arange(len(steps)) < start)
        backward = lambda at: np.nanmedian(matrix(others, lambda d: d.phases["backward"], steps[at]))  # noqa: E731
        wait = float(backward(mask) - (backward(before) if before.any() else 0.0))
        n_slow, ex, med = int(mask.sum()), float(np.nanmedian(excess[i, mask])), float(np.nanmedian(med_step[mask]))
        first, last = int(steps[start]), int(steps[np.flatnonzero(mask)[-1]])
        waited = f"; the other ranks' backward took {wait:.3g} s longer on those steps: they waited for it " \
                 "in the gradient all-reduce" if np.isfinite(wait) and wait > 0.5 * ex else ""
        findings.append(Finding(
            KIND, "warning", first, [],
            f"Rank {r} is a straggler from step {first:,}: on {n_slow:,} steps (to step {last:,}) its own work took "
            f"{ex:.3g} s longer than the median rank's ({100 * ex / med:.0f}% of a {med:.3g} s step), most of it "
            f"in {SPENT_IN[phase]}{waited}.",
            {"phase": phase, "excess_s": ex, "median_step_s": med, "slow_steps": n_slow, "last_slow_step": last,
             "others_wait_s": wait},
            _ADVICE[phase], rank=r))
    return findings


# Steps judged at once: the (ranks x steps) matrices are built a block of steps at a time, so that
# 1,024 ranks x 10,000 steps need ~10 of (1,024 x 512) float64 at once, not of (1,024 x 10,000).
BLOCK_STEPS = 512


def _per_step(digests, steps: np.ndarray, cfg: StragglerConfig):
    """Per rank and step, its own work's excess over the median of the other ranks' and whether
    that makes the step slow; per step, the median rank's step time and own phases. Every value is
    of one step (column) alone, so a block of steps at a time gives exactly the whole's."""
    n_ranks, n = len(digests), len(steps)
    excess, slow = np.empty((n_ranks, n)), np.empty((n_ranks, n), dtype=bool)
    med_step, phase_med = np.empty(n), {p: np.empty(n) for p in OWN_PHASES}
    for a in range(0, n, BLOCK_STEPS):
        at, cols = slice(a, a + BLOCK_STEPS), steps[a:a + BLOCK_STEPS]
        ph = {p: matrix(digests, lambda d, p=p: d.phases[p], cols) for p in OWN_PHASES}
        own = np.nansum(np.stack([ph[p] for p in OWN_PHASES]), axis=0)  # (ranks x steps)
        med_step[at] = np.nanmedian(matrix(digests, lambda d: d.step_s, cols), axis=0)
        # Against the median of the other ranks (with two ranks, the other one's).
        excess[:, at] = own - median_of_others(own)
        for p in OWN_PHASES:
            phase_med[p][at] = np.nanmedian(ph[p], axis=0)  # (the median rank's, per step)
        slow[:, at] = excess[:, at] >= np.maximum(cfg.min_excess_s, cfg.min_excess_share * med_step[at])
    return excess, slow, med_step, phase_med


def median_of_others(x: np.ndarray) -> np.ndarray:
    """Per column of ``x`` (ranks x steps), each row's median of the other rows' values, NaN
    skipped (np.nanmedian of x without that row; NaN where the others have no value): exactly,
    from one sort of each column, not one median per row (ranks^2 x steps)."""
    n = x.shape[0]
    order = np.argsort(x, axis=0, kind="stable")  # (NaN last)
    ordered = np.take_along_axis(x, order, axis=0)
    pos = np.empty_like(order)  # each row's place in its column's order
    np.put_along_axis(pos, order, np.arange(n)[:, None], axis=0)
    present = ~np.isnan(x)
    others = present.sum(axis=0) - present  # values among the other rows
    # The k-th smallest of the others: the k-th of the column, one further from the row's own place on.

    def kth(k):
        k = np.where(present & (k >= pos), k + 1, k)
        return np.take_along_axis(ordered, np.clip(k, 0, n - 1), axis=0)

    with np.errstate(invalid="ignore"):
        med = (kth((others - 1) // 2) + kth(others // 2)) / 2
    med[others == 0] = np.nan
    return med


_ADVICE = {
    "data": "Its data loading is slower: look at that rank's DataLoader (num_workers, a slow or remote shard, "
            "decoding on the main process), its host (CPU contention, another job on the node) and its storage.",
    "between_steps": "It does more work between steps than the others: logging, metrics, checkpointing or "
                     "evaluation on that rank only (often rank 0), or a host busier than the others.",
    "forward": "Its forward is slower: a slower or throttled GPU (check clocks and temperature with nvidia-smi), "
               "longer sequences in its batches (pack or bucket by length), or CPU contention on its host.",
}
