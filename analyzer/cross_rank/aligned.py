"""The ranks' per-step series side by side: a (ranks x steps) matrix over the steps every rank
recorded, for the cross-rank detectors and the report's rank x step pictures."""

from __future__ import annotations

import numpy as np

from .digest import RankDigest


def common_steps(digests: dict[int, RankDigest], of=lambda d: d.steps) -> np.ndarray:
    """The steps every rank recorded (``of``: which steps of a digest, default its steps)."""
    steps = None
    for d in digests.values():
        steps = of(d) if steps is None else np.intersect1d(steps, of(d), assume_unique=True)
    return np.zeros(0, dtype=np.int64) if steps is None else steps


def matrix(digests: dict[int, RankDigest], series, steps: np.ndarray) -> np.ndarray:
    """float64 (ranks in order x steps): ``series(digest)`` (one value per its step) at ``steps``."""
    out = np.full((len(digests), len(steps)), np.nan)
    for i, (_, d) in enumerate(sorted(digests.items())):
        pos = np.searchsorted(d.steps, steps)
        ok = (pos < len(d.steps)) & (d.steps[np.minimum(pos, len(d.steps) - 1)] == steps) if len(d.steps) else \
            np.zeros(len(steps), dtype=bool)
        values = np.asarray(series(d), dtype=np.float64)
        out[i, ok] = values[pos[ok]]
    return out
