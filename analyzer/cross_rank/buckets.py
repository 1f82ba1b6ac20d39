"""A rank's per-step series reduced where the rank is read (the worker) to at most MAX_BUCKETS
buckets of steps, for the report's rank x step pictures and its many-rank lines: so the parent's
memory grows with ranks x buckets, not ranks x steps.

A bucket is an aligned range of ``width`` steps (width a power of two, the smallest that fits the
rank's steps in MAX_BUCKETS), so buckets of ranks that chose different widths (a rank that stopped
early) line up after coarsening to the widest (``coarsened``). Each bucket keeps each series'
smallest and largest finite value (the picture draws the more deviating of the two: no spike
lost), its finite sum and count (the bucket's mean, for the median rank's line) and whether any
value in it was NaN/Inf or missing."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

MAX_BUCKETS = 400  # the report's step columns (reports/ranks.py MAX_COLS)


def width_for(last_step: int) -> int:
    """The smallest power of two w such that steps 0..last_step fall in at most MAX_BUCKETS buckets of w."""
    w = 1
    while max(int(last_step), 0) // w + 1 > MAX_BUCKETS:
        w *= 2
    return w


@dataclass
class Buckets:
    width: int
    index: np.ndarray  # the bucket numbers (step // width) holding steps of this rank, ascending
    lo: dict  # series -> float32 smallest finite value of each bucket (NaN: none finite)
    hi: dict  # series -> float32 largest finite value
    total: dict  # series -> float64 sum of the finite values
    finite: dict  # series -> int32 count of the finite values
    nonfinite: dict  # series -> bool: a NaN/Inf value in the bucket

    @classmethod
    def of(cls, steps: np.ndarray, series: dict, width: int) -> Buckets:
        """The buckets of ``series`` (name -> one value per step of ``steps``, ascending)."""
        b = np.asarray(steps, dtype=np.int64) // width
        index, starts = np.unique(b, return_index=True)
        lo, hi, total, finite, nonfinite = {}, {}, {}, {}, {}
        for name, v in series.items():
            v = np.asarray(v, dtype=np.float64)
            ok = np.isfinite(v)
            if not len(v):
                lo[name] = hi[name] = np.zeros(0, np.float32)
                total[name], finite[name], nonfinite[name] = np.zeros(0), np.zeros(0, np.int32), np.zeros(0, bool)
                continue
            f = np.where(ok, v, np.nan)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                lo[name] = np.fmin.reduceat(f, starts).astype(np.float32)
                hi[name] = np.fmax.reduceat(f, starts).astype(np.float32)
            total[name] = np.add.reduceat(np.where(ok, v, 0.0), starts)
            finite[name] = np.add.reduceat(ok.astype(np.int32), starts)
            nonfinite[name] = np.logical_or.reduceat(~ok, starts)
        return cls(width, index, lo, hi, total, finite, nonfinite)

    def mean(self, name: str) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.finite[name] > 0, self.total[name] / np.maximum(self.finite[name], 1), np.nan)

    def coarsened(self, width: int) -> Buckets:
        """The same values in buckets of ``width`` (a multiple of this width: both powers of two)."""
        if width == self.width or not len(self.index):
            return self
        b = self.index * self.width // width
        index, starts = np.unique(b, return_index=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return Buckets(width, index,
                           {k: np.fmin.reduceat(v, starts) for k, v in self.lo.items()},
                           {k: np.fmax.reduceat(v, starts) for k, v in self.hi.items()},
                           {k: np.add.reduceat(v, starts) for k, v in self.total.items()},
                           {k: np.add.reduceat(v, starts) for k, v in self.finite.items()},
                           {k: np.logical_or.reduceat(v, starts) for k, v in self.nonfinite.items()})


def side_by_side(buckets: dict, name: str):
    """The ranks' buckets of one series aligned: (columns: bucket start steps, and the end of the
    last; lo, hi, mean, nonfinite, missing: ranks in order x columns), or None if no rank has it."""
    held = {r: b for r, b in buckets.items() if b is not None and name in b.lo}
    if not held:
        return None
    width = max(b.width for b in held.values())
    held = {r: b.coarsened(width) for r, b in sorted(held.items())}
    cols = np.unique(np.concatenate([b.index for b in held.values()]))
    shape = (len(held), len(cols))
    lo, hi, mean = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    nonfinite, missing = np.zeros(shape, bool), np.ones(shape, bool)
    for i, b in enumerate(held.values()):
        at = np.searchsorted(cols, b.index)
        lo[i, at], hi[i, at], mean[i, at] = b.lo[name], b.hi[name], b.mean(name)
        nonfinite[i, at], missing[i, at] = b.nonfinite[name], False
    edges = np.append(cols, cols[-1] + 1) * width if len(cols) else np.zeros(1)
    return list(held), edges.astype(float), lo, hi, mean, nonfinite, missing
