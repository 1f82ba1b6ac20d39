"""Exact counters of what the replica and hang detectors compare across ranks, made where the
ranks are read and merged as a tree (the same tree as the straggler's sketches on a Dask
cluster, analyzer/cluster_passes.py; the same code in this process on the local path), so that
the process that judges holds merged counts and the few odd ranks, not every rank's rows.

- ``Fingerprints``: at each fingerprint step every counted rank recorded, how many ranks hold
  each fingerprint hash (divergence.py: the majority, and who left it);
- ``Positions``: where each rank stood when the job stopped (hang.py: the step in progress and
  its phase, the line of its stack), how many ranks stood at each place, and the smallest rank's
  state at each place (the one a finding names).

Both are built from ``Tally``: per value a count, the smallest rank and the ranks that hold it,
listed for every value but the most common one, whose ranks are the counted ranks not listed.
So a tally costs the odd ranks, not all of them, while staying exact: which rank holds which
value is never lost, whatever the order or shape of the merges (a merge adds counts, takes the
smaller first rank, joins the lists, and lists the new most common value's ranks no more). Ties
for the most common value go to the value of the smaller first rank, so every tree of merges
gives the same tally as merging the ranks one by one (tests/analyzer/test_counters.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FAN = 8  # tallies merged at once in this process (cluster_passes.FAN on a Dask cluster)
_NONE = np.zeros(0, dtype=np.int64)


@dataclass
class Tally:
    members: np.ndarray  # the counted ranks, sorted (int64)
    count: dict = field(default_factory=dict)  # value -> how many ranks hold it
    first: dict = field(default_factory=dict)  # value -> the smallest rank holding it
    listed: dict = field(default_factory=dict)  # value -> its ranks, sorted; every value but most()

    def most(self):
        """The most common value (ties: the one held by the smaller rank); None if none is counted."""
        return min(self.count, key=lambda v: (-self.count[v], self.first[v]), default=None)

    def ranks_of(self, value) -> np.ndarray:
        """The ranks that hold ``value`` (sorted)."""
        if value in self.listed:
            return self.listed[value]
        if value not in self.count:
            return _NONE
        others = list(self.listed.values())  # (the most common value's: the members not listed)
        return np.setdiff1d(self.members, np.concatenate(others), assume_unique=True) if others else self.members


def one(rank: int, value) -> Tally:
    return Tally(np.array([rank], dtype=np.int64), {value: 1}, {value: int(rank)}, {})


def merged_tallies(parts: list[Tally], members: np.ndarray | None = None) -> Tally:
    """One tally of several over disjoint ranks (``members``: their union, if known)."""
    if members is None:
        members = np.sort(np.concatenate([p.members for p in parts])) if parts else _NONE
    count: dict = {}
    first: dict = {}
    for p in parts:
        for v, n in p.count.items():
            count[v] = count.get(v, 0) + n
            first[v] = min(first.get(v, p.first[v]), p.first[v])
    out = Tally(members, count, first)
    top = out.most()
    for v in count:
        if v != top:
            held = [p.ranks_of(v) for p in parts if v in p.count]
            out.listed[v] = held[0] if len(held) == 1 else np.sort(np.concatenate(held))
    return out


@dataclass
class Fingerprints:
    """The fingerprint hashes of the ranks that hold whole replicas (DDP) and wrote fingerprints."""
    members: np.ndarray  # those ranks, sorted
    names: tuple | None  # their parameters' names (None: no such rank)
    mixed: bool  # their parameters' names differ: not replicas of one model
    steps: np.ndarray | None  # the fingerprint steps all of them recorded (None: no such rank)
    at: list  # a Tally of hashes per step of ``steps``


@dataclass
class Positions:
    """Where the ranks that could say so (a heartbeat, or a trace that ended) stood at the end."""
    tally: Tally  # place (hang.place()) -> ranks
    rep: dict  # place -> the state of its smallest rank: {"state", "last_step", "end_reason"}
    stalled: bool  # a rank's last heartbeat found its step stalled
    nccl: tuple | None  # (rank, its NCCL environment) of the smallest rank that recorded one


@dataclass
class Counts:
    fingerprints: Fingerprints
    positions: Positions


def leaf(d, hang_cfg) -> Counts:
    """The counts of one rank, from its digest (a RankDigest, or a Light: the same fields);
    without ``hang_cfg`` (a HangConfig) no position is counted."""
    from .hang import place, where_stopped

    r = int(d.rank)
    if d.replicated and len(d.fp_steps):
        fp = Fingerprints(np.array([r], dtype=np.int64), tuple(d.param_names), False, np.asarray(d.fp_steps),
                          [one(r, int(h)) for h in d.fp_hash])
    else:
        fp = Fingerprints(_NONE, None, False, None, [])
    state = None if hang_cfg is None else where_stopped(d, hang_cfg)
    if hang_cfg is not None and (d.heartbeat_s > 0 or state is not None):
        p = place(state, d.last_step)
        pos = Positions(one(r, p), {p: {"state": state, "last_step": d.last_step, "end_reason": d.end_reason}},
                        bool(state and state["stalled"]), None)
    else:
        pos = Positions(Tally(_NONE), {}, False, None)
    pos.nccl = (r, dict(d.nccl_env)) if d.nccl_env else None
    return Counts(fp, pos)


def merged(parts: list[Counts]) -> Counts:
    """One Counts of several over disjoint ranks: associative and the same in any grouping."""
    return Counts(_fingerprints([p.fingerprints for p in parts]), _positions([p.positions for p in parts]))


def _fingerprints(parts: list[Fingerprints]) -> Fingerprints:
    held = [p for p in parts if p.steps is not None]
    if not held:
        return Fingerprints(_NONE, None, False, None, [])
    members = np.sort(np.concatenate([p.members for p in held]))
    names = held[0].names
    mixed = any(p.mixed or p.names != names for p in held)
    steps = held[0].steps
    for p in held[1:]:
        steps = np.intersect1d(steps, p.steps, assume_unique=True)
    at = [np.searchsorted(p.steps, steps) for p in held]
    tallies = [merged_tallies([p.at[i[j]] for p, i in zip(held, at)], members) for j in range(len(steps))]
    return Fingerprints(members, names, mixed, steps, tallies)


def _positions(parts: list[Positions]) -> Positions:
    tally = merged_tallies([p.tally for p in parts])
    rep = {}
    for p in parts:  # (each place's state: its smallest rank's, the one a finding names)
        for k, s in p.rep.items():
            if tally.first[k] == p.tally.first[k]:
                rep[k] = s
    nccl = min((p.nccl for p in parts if p.nccl is not None), key=lambda x: x[0], default=None)
    return Positions(tally, rep, any(p.stalled for p in parts), nccl)


def tree(parts: list[Counts], fan: int = FAN) -> Counts | None:
    """Merged FAN at a time, level by level (as the Dask tree does); None for no part."""
    while len(parts) > 1:
        parts = [merged(parts[i:i + fan]) for i in range(0, len(parts), fan)]
    return parts[0] if parts else None


def of(digests: dict, hang_cfg) -> Counts | None:
    """The Counts of digests held in this process (the local path, or a run of one rank)."""
    return tree([leaf(d, hang_cfg) for _, d in sorted(digests.items())])
