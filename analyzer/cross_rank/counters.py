"""Exact counters of what the replica and hang detectors compare across ranks, made where the
ranks are read and merged as a tree (the same tree as the straggler's sketches on a Dask
cluster, analyzer/cluster_passes.py; the same code in this process on the local path), so that
the process that judges holds merged counts and the few odd ranks, not every rank's rows.

- ``Fingerprints``: at each fingerprint step any counted rank recorded, how many ranks hold
  each fingerprint hash, the ranks that did not record it counted as holding ABSENT
  (divergence.py: the majority, and who left it, at the steps all recorded; the report's replica
  picture: at every step);
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

LEAF, FAN = 32, 8  # ranks a leaf, partials a merge, in this process (as cluster_passes' on a Dask cluster)
_NONE = np.zeros(0, dtype=np.int64)
ABSENT = 1 << 64  # the "hash" of a rank without a fingerprint at a step (no int64 hash equals it)


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


def tally(ranks: np.ndarray, values: np.ndarray) -> Tally:
    """The tally of ranks (sorted, int64) holding values (one each, int64)."""
    if len(ranks) and (values == values[0]).all():  # (the usual: every rank holds one value)
        v = int(values[0])
        return Tally(ranks, {v: len(ranks)}, {v: int(ranks[0])}, {})
    vs, at, inv, n = np.unique(values, return_index=True, return_inverse=True, return_counts=True)
    out = Tally(ranks, dict(zip(vs.tolist(), n.tolist())), dict(zip(vs.tolist(), ranks[at].tolist())))
    top = out.most()
    out.listed = {v: ranks[inv.ravel() == i] for i, v in enumerate(vs.tolist()) if v != top}
    return out


def tally_of(held: dict) -> Tally:
    """The tally of {rank: value} (values any hashable)."""
    ranks = np.array(sorted(held), dtype=np.int64)
    by: dict = {}
    for r in ranks.tolist():
        by.setdefault(held[r], []).append(r)
    out = Tally(ranks, {v: len(rs) for v, rs in by.items()}, {v: rs[0] for v, rs in by.items()})
    top = out.most()
    out.listed = {v: np.array(rs, dtype=np.int64) for v, rs in by.items() if v != top}
    return out


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
    steps: np.ndarray | None  # the fingerprint steps any of them recorded (None: no such rank)
    at: list  # a Tally of hashes (ABSENT: not recorded) per step of ``steps``

    def full(self) -> list[int]:
        """The indices of the steps every member recorded (the ones the detector compares)."""
        return [k for k, t in enumerate(self.at) if ABSENT not in t.count]


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


def leaf(ds: list, hang_cfg) -> Counts:
    """The counts of a group of ranks, from their full digests (RankDigests: a Light keeps no
    fingerprint or heartbeat); without ``hang_cfg`` (a HangConfig) no position is counted."""
    from .hang import place, where_stopped

    ds = sorted(ds, key=lambda d: d.rank)
    reps = [d for d in ds if d.replicated and len(d.fp_steps)]
    fp = Fingerprints(_NONE, None, False, None, [])
    if reps:
        members = np.array([d.rank for d in reps], dtype=np.int64)
        names = tuple(reps[0].param_names)
        own = [np.unique(d.fp_steps, return_index=True) for d in reps]  # (each step once: its first row)
        steps = np.unique(np.concatenate([u for u, _ in own]))
        if all(len(u) == len(steps) for u, _ in own):  # (the usual: every rank recorded every step)
            h = np.stack([np.asarray(d.fp_hash, dtype=np.int64)[i] for d, (_, i) in zip(reps, own)])
            tallies = [tally(members, h[:, j]) for j in range(len(steps))]
        else:
            at = [[] for _ in steps]  # (per step: (the rank's index in reps, its hash) of those that recorded it)
            for i, (d, (u, first)) in enumerate(zip(reps, own)):
                for k, h in zip(np.searchsorted(steps, u).tolist(), np.asarray(d.fp_hash, dtype=np.int64)[first].tolist()):
                    at[k].append((i, h))
            tallies = [_recorded(members, held) for held in at]
        fp = Fingerprints(members, names, any(tuple(d.param_names) != names for d in reps[1:]), steps, tallies)
    held, rep, stalled = {}, {}, False
    for d in ds if hang_cfg is not None else ():
        state = where_stopped(d, hang_cfg)
        if d.heartbeat_s > 0 or state is not None:
            p = held[int(d.rank)] = place(state, d.last_step)
            stalled = stalled or bool(state and state["stalled"])
            if p not in rep:  # (its smallest rank's: the one a finding names)
                rep[p] = {"state": state, "last_step": d.last_step, "end_reason": d.end_reason}
    nccl = next(((int(d.rank), dict(d.nccl_env)) for d in ds if d.nccl_env), None)
    return Counts(fp, Positions(tally_of(held), rep, stalled, nccl))


def _recorded(members: np.ndarray, held: list) -> Tally:
    """The tally of a step: the hashes of the ranks that recorded it (``held``: (index in members,
    hash)), ABSENT for the others."""
    if len(held) == len(members):
        return tally(members, np.array([h for _, h in held], dtype=np.int64))
    idx = np.array([i for i, _ in held], dtype=np.int64)
    parts = [tally(members[idx], np.array([h for _, h in held], dtype=np.int64))] if len(held) else []
    absent = np.setdiff1d(members, members[idx], assume_unique=True) if len(held) else members
    return merged_tallies(parts + [_absent(absent)], members)


def _absent(ranks: np.ndarray) -> Tally:
    return Tally(ranks, {ABSENT: len(ranks)}, {ABSENT: int(ranks[0])}, {})


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
    steps = np.unique(np.concatenate([p.steps for p in held]))
    at = [np.searchsorted(p.steps, steps) for p in held]
    tallies = []
    for j in range(len(steps)):  # (a part that did not record the step: all its ranks ABSENT)
        tallies.append(merged_tallies([p.at[i[j]] if i[j] < len(p.steps) and p.steps[i[j]] == steps[j]
                                       else _absent(p.members) for p, i in zip(held, at)], members))
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


def of(digests: dict, hang_cfg, group: int = LEAF) -> Counts | None:
    """The Counts of digests held in this process (the local path, or a run of one rank), made
    as the Dask path makes them: leaves of ``group`` ranks, merged FAN at a time."""
    ds = [d for _, d in sorted(digests.items())]
    return tree([leaf(ds[i:i + group], hang_cfg) for i in range(0, len(ds), group)])
