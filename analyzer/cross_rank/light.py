"""What the parent keeps of a rank: its digest without its per-step series (``Light``). The
series stay where the rank was read; what leaves it is bounded whatever the number of steps:
their buckets (buckets.py, for the pictures), the exact values the cross-rank stage asks of it
(the straggler's verdict judged against the ranks' per-step references, its loss and own gradient
norm around each step it has a finding at, its peak memory up to the steps other ranks ran out of
memory at), and its end as a few scalars (the time of its last step and of its last heartbeat,
where that heartbeat found it).

Not kept: its fingerprint hashes and heartbeats. The replica and hang detectors, and the report's
replica picture and ends table, read the ranks' merged counters (counters.py: counts and the odd
ranks, made where the ranks are read); the hang figure reads the few ranks it draws from their
files. So the parent's memory a rank is flat in steps and in fingerprints.

Exact: every finding (the detectors read only exact values). Bucketed: the report's rank x step
pictures and its many-rank loss, memory and straggler lines."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .buckets import Buckets

BEFORE = 20  # the steps before a finding whose values leave with it (local.py's usual value)


@dataclass
class Light:
    rank: int
    file: str
    n_steps: int
    last_step: int | None
    last_time: float  # its last step's rec.step() time (the last finite one; NaN: none)
    end_time: float  # its last heartbeat's time, else its last step's (NaN: neither)
    memory_kind: str
    closed_cleanly: bool
    end_reason: str
    beat: dict | None  # hang.last_beat() without the stack: where its last heartbeat after its last step found it
    blackbox_fired: bool
    local_measured: bool  # its own (pre-all-reduce) gradient norm was recorded
    buckets: Buckets | None
    near: dict = field(default_factory=dict)  # step -> near_at(): values around its findings' steps
    peaks: dict = field(default_factory=dict)  # step -> its peak memory up to that step (None: none)
    straggle: dict | None = None  # straggler.verdict() (None: not a straggler)


def finding_steps(found) -> set[int]:
    return {int(f.step) for f in found if f.step is not None}


def oom_steps(results) -> list[int]:
    """The steps at which a rank ran out of memory: every rank's peak memory up to them is asked for."""
    return sorted({int(f.step) for found, _ in results for f in found
                   if f.kind == "out_of_memory" and f.step is not None})


def near_at(d, step: int) -> dict | None:
    """A full digest's values at ``step`` and the BEFORE steps before it: {"i": its index,
    "loss", "local_grad": the windows ending at it}; None if it did not record that step."""
    i = int(np.searchsorted(d.steps, step))
    if i >= len(d.steps) or d.steps[i] != step:
        return None
    a = max(0, i - BEFORE)
    return {"i": i, "loss": np.array(d.loss[a:i + 1]), "local_grad": np.array(d.local_grad[a:i + 1])}


def peak_by(d, step: int) -> float | None:
    """A full digest's largest memory value up to ``step``; None if none was measured."""
    m = d.memory[d.steps <= step]
    m = m[np.isfinite(m)]
    return float(m.max()) if len(m) else None


def light(d, finding_steps=(), peak_steps=(), straggle: dict | None = None) -> Light:
    """The Light of a full RankDigest: ``finding_steps`` the steps of its own findings (near),
    ``peak_steps`` those at which another rank ran out of memory (peaks)."""
    from .hang import last_beat  # (hang reads Lights: imported here, not at the top)

    near = {int(s): w for s in sorted(set(finding_steps)) if (w := near_at(d, int(s))) is not None}
    t = d.time_unix[np.isfinite(d.time_unix)]
    last = float(d.time_unix[-1]) if len(d.time_unix) else np.nan
    beat = last_beat(d)
    return Light(
        rank=d.rank, file=d.file, n_steps=len(d.steps), last_step=d.last_step,
        last_time=float(t[-1]) if len(t) else np.nan,
        end_time=float(d.heartbeats[-1]["time_unix"]) if d.heartbeats else last, memory_kind=d.memory_kind,
        closed_cleanly=d.closed_cleanly, end_reason=d.end_reason,
        beat=None if beat is None else {k: v for k, v in beat.items() if k != "stack"},
        blackbox_fired=d.blackbox_fired,
        local_measured=bool(np.isfinite(d.local_grad).any()) if len(d.local_grad) else False,
        buckets=d.buckets, near=near, peaks={int(s): peak_by(d, int(s)) for s in set(peak_steps)}, straggle=straggle)
