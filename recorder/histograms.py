"""Fixed-bin histograms of weights, gradients and activations, computed on the device.

The bins are the same for every tensor and every step, so histograms compare across steps and
layers: NaN, -Inf, then negative magnitudes from the largest to the smallest, one bin for zero
and magnitudes below 2**LO_EXP, positive magnitudes from the smallest to the largest, +Inf.
Magnitude bins are half octaves, [2**(LO_EXP + k/2), 2**(LO_EXP + (k+1)/2)), from 2**-40
(below any gradient worth telling from zero in float32 training) to 2**8; finite magnitudes
above the range are counted in the outermost bin of their sign. NaN and +-Inf are never dropped.
"""

from __future__ import annotations

import numpy as np
import torch

LO_EXP = -40  # smallest magnitude with a bin of its own: 2**-40 (~9.1e-13)
HI_EXP = 8  # magnitudes from 2**8 (256) up share the outermost bin
PER_OCTAVE = 2
N_MAG = (HI_EXP - LO_EXP) * PER_OCTAVE  # 96 magnitude bins per sign
NAN_BIN, NEG_INF_BIN = 0, 1
ZERO_BIN = 2 + N_MAG  # 98
POS_INF_BIN = ZERO_BIN + N_MAG + 1  # 195
N_BINS = POS_INF_BIN + 1  # 196


def bin_edges() -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) value edges of every bin, float64; NaN bin: (nan, nan); the zero bin
    spans (-2**LO_EXP, 2**LO_EXP); outermost magnitude bins reach to -+ float max."""
    lo = np.full(N_BINS, np.nan)
    hi = np.full(N_BINS, np.nan)
    mags = 2.0 ** (LO_EXP + np.arange(N_MAG + 1) / PER_OCTAVE)
    big = float(np.finfo(np.float64).max)
    lo[NEG_INF_BIN], hi[NEG_INF_BIN] = -np.inf, -np.inf
    for k in range(N_MAG):  # positive bin ZERO_BIN+1+k holds [mags[k], mags[k+1])
        lo[ZERO_BIN + 1 + k], hi[ZERO_BIN + 1 + k] = mags[k], mags[k + 1]
        lo[ZERO_BIN - 1 - k], hi[ZERO_BIN - 1 - k] = -mags[k + 1], -mags[k]
    hi[POS_INF_BIN - 1] = big
    lo[NEG_INF_BIN + 1] = -big
    lo[ZERO_BIN], hi[ZERO_BIN] = -mags[0], mags[0]
    lo[POS_INF_BIN], hi[POS_INF_BIN] = np.inf, np.inf
    return lo, hi


def histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts of x's elements per bin (int64, N_BINS), on x's device; reads x, never writes it.

    Costs a few elementwise passes over x (log2, floor, where) and one bincount; float16 and
    bfloat16 are widened to float32 first (their log2 in half precision would move edges)."""
    x = x.detach().reshape(-1)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    a = x.abs()
    k = torch.floor((torch.log2(a) - LO_EXP) * PER_OCTAVE).clamp_(0, N_MAG - 1)
    k = torch.nan_to_num(k, nan=0.0).long()  # NaN, +-Inf and 0 are binned below
    idx = torch.where(x > 0, ZERO_BIN + 1 + k, ZERO_BIN - 1 - k)
    idx = torch.where(a < 2.0 ** LO_EXP, ZERO_BIN, idx)
    idx = torch.where(torch.isnan(x), NAN_BIN, idx)
    idx = torch.where(torch.isinf(x), torch.where(x > 0, POS_INF_BIN, NEG_INF_BIN), idx)
    return torch.bincount(idx, minlength=N_BINS)


def spread(n: int, limit: int) -> list[int]:
    """At most ``limit`` indices of range(n), evenly spread, first and last included."""
    if n <= limit:
        return list(range(n))
    return sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
