"""The straggler's per-step references (step_refs.Refs) on a Dask cluster: per step and series, an
Apache DataSketches KLL sketch of the ranks' values, built for a group of ranks where their
digests are (a worker), merged in a tree (partials of partials: no process ever holds all ranks'
rows) and read off at the root. KLL rather than a hand-written sketch: a mergeable quantile
sketch with proven rank-error bounds, kept by the DataSketches project; it skips NaN as
np.nanmedian does. Imported only on the Dask path (the ``cluster`` extra brings datasketches)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .aligned import common_steps
from .step_refs import SERIES, WINDOW, Refs, low, series_of

# KLL's accuracy parameter: a normalized rank error of ~1.65% (the library's default); the sketch
# is exact (keeps every value) until a step has more values than its first level holds (~k).
K = 200


@dataclass
class Partial:
    steps: np.ndarray  # the steps every rank of the partial recorded
    sketches: dict  # series -> [serialized kll_doubles_sketch per step]


def _new():
    from datasketches import kll_doubles_sketch

    return kll_doubles_sketch(K)


def _load(b: bytes):
    from datasketches import kll_doubles_sketch

    return kll_doubles_sketch.deserialize(b)


def leaf(digests: list) -> Partial:
    """The sketches of a group of ranks' digests (each a RankDigest) over their common steps."""
    ds = {i: d for i, d in enumerate(digests)}
    steps = common_steps(ds)
    rows = [series_of(d, steps) for d in digests]
    out = {}
    for s in SERIES:
        m = np.ascontiguousarray(np.stack([row[s] for row in rows]).T)  # (steps x ranks)
        sk = []
        for values in m:
            k = _new()
            k.update(values)
            sk.append(k.serialize())
        out[s] = sk
    return Partial(steps, out)


def merged(parts: list[Partial]) -> Partial:
    """One partial of several: the steps all of them hold, each step's sketches merged."""
    steps = parts[0].steps
    for p in parts[1:]:
        steps = np.intersect1d(steps, p.steps, assume_unique=True)
    at = [np.searchsorted(p.steps, steps) for p in parts]
    out = {}
    for s in SERIES:
        sk = []
        for j in range(len(steps)):
            k = _load(parts[0].sketches[s][at[0][j]])
            for p, idx in zip(parts[1:], at[1:]):
                k.merge(_load(p.sketches[s][idx[j]]))
            sk.append(k.serialize())
        out[s] = sk
    return Partial(steps, out)


def refs(part: Partial) -> Refs:
    """The per-step order statistics around the median, read off the root's sketches: the j-th
    smallest of n as the quantile at normalized rank (j + 0.5) / n (exact while the sketch holds
    every value)."""
    m = len(part.steps)
    n = {s: np.zeros(m, np.int64) for s in SERIES}
    stats = {s: np.full((m, WINDOW), np.nan) for s in SERIES}
    for s in SERIES:
        for j, b in enumerate(part.sketches[s]):
            k = _load(b)
            count = int(k.n)
            n[s][j] = count
            if count:
                lo = int(low(count))
                qs = [(i + 0.5) / count for i in range(lo, min(lo + WINDOW, count))]
                stats[s][j, :len(qs)] = k.get_quantiles(qs)
    return Refs(part.steps, n, stats)
