"""straggler (warning): one rank's steps take longer than the others', from some step on, and in
which phase.

Under data parallelism the ranks meet in the gradient all-reduce, so a slow rank makes every
rank's step as slow as its own: total step time does not tell it. What does is where each rank
spends the step: the straggler spends its extra time in its own work (waiting for its data,
between steps, its forward), the others spend the same time waiting in the collective, inside
their backward. Per step, each rank's own work is compared with the median rank's; a rank whose
excess is at least `min_excess_share` of the median step (and `min_excess_s`) on most steps of a
window of `window` steps is a straggler from the first slow step of that window.

Each rank is judged alone against the ranks' per-step references (step_refs.py: the order
statistics around each step's median, from which the median of the *other* ranks follows
exactly): in this process from every rank's digest, or on a Dask cluster where the rank is read
against references from merged KLL sketches (analyzer/cluster_passes.py); ``detect`` turns the
verdicts into findings.

A rank whose backward itself is slow (a slow GPU's kernels) cannot be told this way: every rank
leaves the all-reduce together; host timing cannot say who was late (benchmarks/README.md)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..trace.phases import SPENT_IN
from . import step_refs
from .aligned import common_steps
from .step_refs import OWN_PHASES


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


def detect(digests, cfg: StragglerConfig, trace=None, counts=None) -> list[Finding]:
    """The stragglers' findings from each rank's verdict (``straggle``, judged where its series
    are: verdict()); a digest without one (a full RankDigest, as tests pass) is judged here.
    (``counts``: the other cross-rank detectors' counters, not read here.)"""
    if len(digests) < 2:
        return []
    verdicts = {r: getattr(d, "straggle", None) for r, d in digests.items()}
    if any(not hasattr(d, "straggle") for d in digests.values()):
        verdicts = verdicts_here(digests, cfg)
    return [_finding(r, v) for r, v in sorted(verdicts.items()) if v]


def verdicts_here(digests, cfg: StragglerConfig) -> dict:
    """{rank: verdict} of full digests held in this process, against exact references."""
    if len(digests) < 2:
        return {r: None for r in digests}
    steps = common_steps(digests)
    refs = step_refs.exact(digests, steps) if len(steps) >= cfg.min_slow_steps else None
    return {r: verdict(d, refs, cfg) for r, d in digests.items()}


def verdict(d, refs: step_refs.Refs | None, cfg: StragglerConfig) -> dict | None:
    """Whether one rank (its full digest) straggles against the ranks' per-step references: per
    step, its own work's excess over the median of the other ranks' and whether that makes the
    step slow; a straggler from the first slow step of a sustained run in a window mostly slow.
    None: not a straggler. Exact per step: the references are (step_refs)."""
    if refs is None or len(refs.steps) < cfg.min_slow_steps:
        return None
    with warnings.catch_warnings():  # (medians of steps no rank timed: NaN, said nothing of)
        warnings.simplefilter("ignore", RuntimeWarning)
        return _verdict(d, refs, cfg)


def _verdict(d, refs, cfg: StragglerConfig) -> dict | None:
    steps = refs.steps
    own = step_refs.series_of(d, steps)
    excess = own["own"] - refs.median_of_others("own", own["own"])
    med_step = refs.median("step")
    with np.errstate(invalid="ignore"):
        slow = excess >= np.maximum(cfg.min_excess_s, cfg.min_excess_share * med_step)
    if slow.sum() < cfg.min_slow_steps:
        return None
    w = max(1, min(cfg.window, len(steps)))
    share = np.convolve(slow, np.ones(w), mode="valid") / w  # share of slow steps in each window
    windows = np.flatnonzero(share >= cfg.min_share)
    if not len(windows):
        return None
    # The onset: the first slow step that begins a sustained run (min_slow_steps slow in a row)
    # -- not an early hiccup such as DDP's bucket rebuild in the second step's forward.
    run = np.convolve(slow, np.ones(cfg.min_slow_steps), mode="valid") >= cfg.min_slow_steps
    sustained = np.flatnonzero(run[windows[0]:]) + windows[0] if len(run) > windows[0] else np.zeros(0, int)
    start = int(sustained[0]) if len(sustained) else windows[0] + int(np.argmax(slow[windows[0]:windows[0] + w]))
    mask = slow.copy()
    mask[:start] = False
    phase_excess = {p: np.nanmedian(own[p][mask] - refs.median(p)[mask]) for p in OWN_PHASES}
    phase = max(phase_excess, key=lambda p: phase_excess[p])
    before = ~mask & (np.arange(len(steps)) < start)
    # The others' backward: per step the median of the other ranks' (their wait shows there).
    back = refs.median_of_others("backward", own["backward"])
    wait = float(np.nanmedian(back[mask]) - (np.nanmedian(back[before]) if before.any() else 0.0))
    return {"first": int(steps[start]), "last": int(steps[np.flatnonzero(mask)[-1]]), "slow_steps": int(mask.sum()),
            "excess_s": float(np.nanmedian(excess[mask])), "median_step_s": float(np.nanmedian(med_step[mask])),
            "phase": phase, "others_wait_s": wait}


def _finding(r: int, v: dict) -> Finding:
    ex, med, wait, phase, first, last = (v["excess_s"], v["median_step_s"], v["others_wait_s"], v["phase"],
                                         v["first"], v["last"])
    waited = f"; the other ranks' backward took {wait:.3g} s longer on those steps: they waited for it " \
             "in the gradient all-reduce" if np.isfinite(wait) and wait > 0.5 * ex else ""
    return Finding(
        KIND, "warning", first, [],
        f"Rank {r} is a straggler from step {first:,}: on {v['slow_steps']:,} steps (to step {last:,}) its own work "
        f"took {ex:.3g} s longer than the median rank's ({100 * ex / med:.0f}% of a {med:.3g} s step), most of it "
        f"in {SPENT_IN[phase]}{waited}.",
        {"phase": phase, "excess_s": ex, "median_step_s": med, "slow_steps": v["slow_steps"], "last_slow_step": last,
         "others_wait_s": wait},
        _ADVICE[phase], rank=r)


_ADVICE = {
    "data": "Its data loading is slower: look at that rank's DataLoader (num_workers, a slow or remote shard, "
            "decoding on the main process), its host (CPU contention, another job on the node) and its storage.",
    "between_steps": "It does more work between steps than the others: logging, metrics, checkpointing or "
                     "evaluation on that rank only (often rank 0), or a host busier than the others.",
    "forward": "Its forward is slower: a slower or throttled GPU (check clocks and temperature with nvidia-smi), "
               "longer sequences in its batches (pack or bucket by length), or CPU contention on its host.",
}
