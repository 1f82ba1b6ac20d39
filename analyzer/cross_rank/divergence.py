"""replica_divergence (error): under data parallelism a rank's parameters left the others'.

DDP's replicas hold bit-identical parameters after every step (the same averaged gradient, the
same optimizer, the same kernels). The recorder writes each parameter's exact bit checksum every
`fingerprint_every` steps (recorder/distributed/fingerprint.py); here the ranks are compared at each such
step. A rank whose checksums differ from the majority's, after a step where all agreed, is a
replica that diverged: silent data corruption (a faulty GPU or memory), or a rank-dependent bug
(an update, a re-initialisation or a checkpoint load on some ranks only). Ranks that never agreed
are not replicas (model or pipeline parallelism): nothing is said. Ranks that agreed, then all
split apart with no majority, are a warning: a rank-dependent update under DDP, or ranks that
train apart by design (local SGD)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from . import counters
from .merge import rank_set


@dataclass(frozen=True)
class ReplicaDivergenceConfig:
    # Parameters named per finding at most (the JSON's `where`).
    max_named: int = 20


class Evidence(FindingEvidence, total=False):
    last_agreed_step: int  # the last fingerprint step where it still held the others' parameters
    params_differing: int  # how many of its parameters differ from the majority's at `step`
    majority_ranks: int  # how many ranks agree with one another at `step`
    fingerprint_every: int  # the steps between fingerprints (the resolution of `step`)


KIND = "replica_divergence"
CONFIG = ReplicaDivergenceConfig
MIN_RANKS = 2  # (what it compares: ranks)
ORDER = 20


def detect(digests, cfg: ReplicaDivergenceConfig, trace=None, counts=None) -> list[Finding]:
    """``counts``: the ranks' merged counters (counters.py; made here from ``digests`` if not given)."""
    if counts is None:
        counts = counters.of(digests, None) if digests else None
    fp = None if counts is None else counts.fingerprints
    if fp is None or len(fp.members) < 2 or fp.mixed:
        return []
    full = fp.full()  # (the steps every rank recorded: where they compare)
    steps, at = fp.steps[full], [fp.at[k] for k in full]
    if not len(steps):
        return []
    ranks = fp.members.tolist()
    agreed = [len(t.count) == 1 for t in at]
    if not any(agreed):
        return []  # never the same parameters: not replicas
    first_agreed = agreed.index(True)
    findings, reported = [], set()
    for k in range(first_agreed + 1, len(steps)):
        t = at[k]
        value = t.most()
        n = t.count[value]
        if n * 2 <= len(ranks):  # no majority: they split apart
            left = [r for r in ranks if r not in reported]
            if left:
                findings.append(_split(steps, k, left, ranks))
            break
        # (the majority's ranks are never listed: the others are, the ranks that left it)
        for r in sorted(int(r) for v, held in t.listed.items() if v != value for r in held):
            if r in reported:
                continue
            reported.add(r)
            findings.append(_diverged(fp.names, trace, steps, k, r, t.first[value], n, len(ranks), cfg))
    return findings


def _diverged(names, trace, steps, k, r, majority, n_majority, n_ranks, cfg) -> Finding:
    step, last = int(steps[k]), int(steps[k - 1])
    names = _differing(names, trace, r, majority, step)
    every = step - last
    when = f"at step {step:,}" if every == 1 else f"between steps {last + 1:,} and {step:,}"
    what = (f"{len(names):,} parameter{'s' if len(names) != 1 else ''} ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})") if names else "its parameters"
    return Finding(
        KIND, "error", step, names[:cfg.max_named],
        f"Rank {r}'s replica left the others {when}: {what} no longer equal the other {n_majority:,} ranks', "
        f"which still agree with one another (bit checksums after the optimizer step; equal on all ranks at "
        f"step {last:,}).",
        {"last_agreed_step": last, "params_differing": len(names), "majority_ranks": n_majority,
         "fingerprint_every": every},
        "Under DDP every replica must hold the same parameters. Look for code that changes parameters on some "
        "ranks only (an update under `if rank == ...`, a checkpoint or weights loaded on one rank, a parameter "
        "written through .data outside the optimizer), and, if there is none, suspect that rank's GPU: silent "
        "data corruption (run the vendor's diagnostics: nvidia-smi -q for ECC errors, dcgmi diag) and move the "
        "job off that node.", rank=r)


def _split(steps, k, left, ranks) -> Finding:
    step = int(steps[k])
    return Finding(
        KIND, "warning", step, [],
        f"The ranks' parameters no longer agree from step {step:,} ({rank_set(left, ranks)}): no majority of ranks "
        f"holds the same parameters, though all did at step {int(steps[k - 1]):,}. Under DDP that is a fault; "
        f"ranks that train apart by design (local SGD, independent runs from one seed) do this too.",
        {"last_agreed_step": int(steps[k - 1]), "majority_ranks": 0, "fingerprint_every": int(steps[k] - steps[k - 1])},
        "Ranks that stop agreeing all at once point at a rank-dependent update (a per-rank seed in the "
        "optimizer or the model, gradients not all-reduced: a parameter outside DDP, no_sync() left on) "
        "rather than one faulty GPU.", rank=None)


def _differing(names, trace, r, majority, step) -> list[str]:
    """The names of the parameters whose checksums differ between rank r and a majority rank at
    ``step``, read from their traces (one row each); [] where the rows cannot be read."""
    if trace is None or r not in trace.ranks or majority not in trace.ranks:
        return []
    try:
        rows = []
        for q in (r, majority):
            rt = trace.ranks[q]
            idx = int(np.searchsorted(rt.fingerprint_steps, step))
            rows.append(rt.fingerprint_rows([idx])[0])
        return [names[i] for i in np.flatnonzero(rows[0] != rows[1])]
    except Exception:  # (a damaged row, a rank restarted into attempts: the finding stands without names)
        return []
