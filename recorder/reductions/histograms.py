"""Fixed-bin histograms of weights, gradients and activations, computed on the device.

The bins are the same for every tensor and every step, so histograms compare across steps and
layers: NaN, -Inf, then negative magnitudes from the largest to the smallest, one bin for zero
and magnitudes below 2**LO_EXP, positive magnitudes from the smallest to the largest, +Inf.
Magnitude bins are half octaves, [2**e, 1.5 * 2**e) and [1.5 * 2**e, 2**(e+1)), from 2**-40
(below any gradient worth telling from zero in float32 training) to 2**8; finite magnitudes
above the range are counted in the outermost bin of their sign. NaN and +-Inf are never dropped.

The bin of a float32 is read from its top 10 bits (sign, exponent, first mantissa bit): one
shift and one bincount over the tensor, then a 1,024-entry table maps codes to bins. That is
~4 ns per element on one CPU core, against ~90 for log2/floor/where (measured, 2M elements).
"""

from __future__ import annotations

import numpy as np
import torch

from .stats import stats_part

LO_EXP = -40  # smallest magnitude with a bin of its own: 2**-40 (~9.1e-13)
HI_EXP = 8  # magnitudes from 2**8 (256) up share the outermost bin
PER_OCTAVE = 2
N_MAG = (HI_EXP - LO_EXP) * PER_OCTAVE  # 96 magnitude bins per sign
NAN_BIN, NEG_INF_BIN = 0, 1
ZERO_BIN = 2 + N_MAG  # 98
POS_INF_BIN = ZERO_BIN + N_MAG + 1  # 195
N_BINS = POS_INF_BIN + 1  # 196
_F32_MAX = float(np.finfo(np.float32).max)
_POS_INF_BITS, _NEG_INF_BITS = 0x7F800000, -0x800000  # float32 +Inf and -Inf as int32


def _code_table() -> np.ndarray:
    """Bin of each 10-bit code (sign, 8 exponent bits, first mantissa bit) of a float32."""
    code = np.arange(1024)
    neg, j = code >> 9, code & 0x1FF  # j: 2 * biased exponent + first mantissa bit
    k = j - 2 * (127 + LO_EXP)
    mag = np.clip(k, 0, N_MAG - 1)
    out = np.where(neg == 0, ZERO_BIN + 1 + mag, ZERO_BIN - 1 - mag)
    out = np.where(k < 0, ZERO_BIN, out)  # zero, subnormals, below 2**LO_EXP
    out = np.where(j == 511, NAN_BIN, out)  # exponent 255, first mantissa bit 1: quiet NaN
    out = np.where(j == 510, np.where(neg == 0, POS_INF_BIN, NEG_INF_BIN), out)  # Inf (or a rare NaN)
    return out.astype(np.int64)


_CODE_TABLE = _code_table()
_TABLES: dict[torch.device, torch.Tensor] = {}


def bin_edges() -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) value edges of every bin, float64; NaN bin: (nan, nan); the zero bin
    spans (-2**LO_EXP, 2**LO_EXP); outermost magnitude bins reach to -+ float max."""
    lo = np.full(N_BINS, np.nan)
    hi = np.full(N_BINS, np.nan)
    k = np.arange(N_MAG + 1)
    mags = 2.0 ** (LO_EXP + k // 2) * np.where(k % 2 == 1, 1.5, 1.0)
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


# A tensor with more elements is histogrammed over its first rows (stats.stats_part): the
# distribution of a weight matrix or a batch's activations, from 262,144 of its elements. All of
# the small transformer's weights, gradients and outputs took ~50 ms per histogram step on one
# core, ~0.6% of its training at every 100 steps (measured): they are on a budget
# (config.histogram_budget).
HIST_MAX_ELEMENTS = 1 << 18


def histogram(x: torch.Tensor, max_elements: int = HIST_MAX_ELEMENTS) -> torch.Tensor:
    """Counts of x's elements per bin (int64, N_BINS), on x's device; reads x, never writes it.
    Of at most `max_elements` of them (the first rows: see HIST_MAX_ELEMENTS).

    float16 and bfloat16 are widened to float32 (exactly); float64 is narrowed, finite values
    saturating at float32's max so that only a real Inf lands in an Inf bin."""
    x = stats_part(x.detach(), max_elements)
    if x.dtype == torch.float64:
        x = torch.where(torch.isfinite(x), x.clamp(-_F32_MAX, _F32_MAX), x)
    if x.dtype != torch.float32:
        x = x.float()
    bits = x.contiguous().view(torch.int32)
    codes = (bits >> 22) & 0x3FF
    if x.device.type == "cpu":
        counts = torch.bincount(codes, minlength=1024)
    else:  # bincount synchronises on CUDA (it reads the largest code first); index_add_ does not
        counts = torch.zeros(1024, dtype=torch.long, device=x.device).index_add_(
            0, codes.flatten(), torch.ones(codes.numel(), dtype=torch.long, device=x.device))
    table = _TABLES.get(x.device)
    if table is None:
        table = _TABLES[x.device] = torch.from_numpy(_CODE_TABLE).to(x.device)
    hist = torch.zeros(N_BINS, dtype=torch.long, device=x.device).index_add_(0, table, counts)
    # Codes 510 / 1022 hold +Inf / -Inf and NaNs whose first mantissa bit is 0 (signalling NaNs,
    # which arithmetic never makes): count the infinities exactly, the rest are NaN. On the CPU,
    # where reading a count is no sync, the two extra passes (~45% of the time) run only if
    # either code occurred.
    if x.device.type == "cpu" and not (counts[510].item() or counts[1022].item()):
        return hist
    pos_inf = torch.count_nonzero(bits == _POS_INF_BITS)
    neg_inf = torch.count_nonzero(bits == _NEG_INF_BITS)
    hist[NAN_BIN] += counts[510] - pos_inf + counts[1022] - neg_inf
    hist[POS_INF_BIN] = pos_inf
    hist[NEG_INF_BIN] = neg_inf
    return hist


def spread(n: int, limit: int) -> list[int]:
    """At most ``limit`` indices of range(n), evenly spread, first and last included."""
    if n <= limit:
        return list(range(n))
    return sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})


def histogram_tensors(n_params: int, is_leaf: list[bool], limit: int) -> tuple[list[int], list[int]]:
    """(parameter indices, module indices) whose histograms are taken: every parameter and leaf
    module (the root, if it is the only module), or an even spread of at most ``limit`` of each
    over the model's depth."""
    leaves = [i for i, leaf in enumerate(is_leaf) if leaf and i > 0 or len(is_leaf) == 1]
    return spread(n_params, limit), [leaves[k] for k in spread(len(leaves), limit)]
