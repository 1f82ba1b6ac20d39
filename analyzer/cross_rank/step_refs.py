"""Per-step references over all ranks, for the straggler: at each step every rank recorded, the
few order statistics around the median of each of the ranks' series (own work, step time, the
phases). From them each rank computes, where its series are, its median rank's values and the
median of the *other* ranks (one rank's own value removed: the k-th smallest of the others is the
k-th or the (k+1)-th of all, by which side of it the rank's value lies), so the parent never needs
a ranks x steps matrix.

Two sources of the same ``Refs``: ``exact`` sorts the ranks' values a block of steps at a time
(the local path, which holds every rank's digest); cross_rank/sketches.py reads them off
Apache DataSketches' KLL sketches merged in a tree (the Dask path): exact while a step's sketch
holds every value (KLL keeps all values until it first compacts: up to ~k ranks, k = 200 here),
then within its rank error (~1.7% of the ranks at k = 200: the median of 1,024 ranks is the
value of a rank between the ~49th and ~51st percentile)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .aligned import matrix

OWN_PHASES = ("data", "between_steps", "forward")
SERIES = ("own", "step", *OWN_PHASES, "backward")
BLOCK_STEPS = 512  # steps sorted at once (1,024 ranks x 512 steps of float64: 4 MB a series)
WINDOW = 3  # order statistics kept per step: indices (n-2)//2 .. (n-2)//2 + 2


def series_of(d, steps: np.ndarray) -> dict[str, np.ndarray]:
    """A rank's series at ``steps`` (float64; NaN where not timed): its own work (data wait,
    between steps, forward: NaN counted 0), its step time, each own phase and its backward."""
    one = {0: d}
    ph = {p: matrix(one, lambda d, p=p: d.phases[p], steps)[0] for p in (*OWN_PHASES, "backward")}
    return {"own": np.nansum(np.stack([ph[p] for p in OWN_PHASES]), axis=0),
            "step": matrix(one, lambda d: d.step_s, steps)[0], **ph}


def low(n: np.ndarray) -> np.ndarray:
    """The index of the first order statistic kept at each step of n values."""
    return np.maximum((np.asarray(n) - 2) // 2, 0)


@dataclass
class Refs:
    steps: np.ndarray  # the steps every rank recorded
    n: dict  # series -> int64 per step: how many ranks had a value (NaN skipped)
    stats: dict  # series -> float64 (steps x WINDOW): the sorted values at low(n), low(n)+1, low(n)+2

    def _s(self, name: str, j: np.ndarray) -> np.ndarray:
        off = np.clip(j - low(self.n[name]), 0, WINDOW - 1)
        return np.take_along_axis(self.stats[name], off[:, None], axis=1)[:, 0]

    def median(self, name: str) -> np.ndarray:
        """The median rank's value at each step (NaN where no rank had one)."""
        n = self.n[name]
        with np.errstate(invalid="ignore"):
            med = (self._s(name, (n - 1) // 2) + self._s(name, n // 2)) / 2
        return np.where(n > 0, med, np.nan)

    def median_of_others(self, name: str, v: np.ndarray) -> np.ndarray:
        """At each step, the median of the other ranks' values of a rank whose value is ``v``
        (NaN: it had none), exactly as np.nanmedian of the others'."""
        n = self.n[name]
        present = ~np.isnan(v)
        m = n - present

        def kth(k):
            own_below = present & (v <= self._s(name, k))  # (its value at or before the k-th: skip it)
            return np.where(own_below, self._s(name, k + 1), self._s(name, k))

        with np.errstate(invalid="ignore"):
            med = (kth((m - 1) // 2) + kth(m // 2)) / 2
        return np.where(m > 0, med, np.nan)


def exact(digests: dict, steps: np.ndarray) -> Refs:
    """Refs of the ranks' digests at ``steps``, from their sorted values, a block of steps at a time."""
    n = {s: np.zeros(len(steps), np.int64) for s in SERIES}
    stats = {s: np.full((len(steps), WINDOW), np.nan) for s in SERIES}
    ranks = sorted(digests)
    for a in range(0, len(steps), BLOCK_STEPS):
        cols = steps[a:a + BLOCK_STEPS]
        rows = [series_of(digests[r], cols) for r in ranks]
        for s in SERIES:
            m = np.sort(np.stack([row[s] for row in rows]), axis=0)  # (NaN last)
            count = (~np.isnan(m)).sum(axis=0)
            lo = low(count)
            for j in range(WINDOW):
                at = lo + j
                stats[s][a:a + len(cols), j] = np.where(
                    at < count, np.take_along_axis(m, np.minimum(at, len(ranks) - 1)[None, :], axis=0)[0], np.nan)
            n[s][a:a + len(cols)] = count
    return Refs(steps, n, stats)
