"""Statistics of the batch as the model receives it, every step: the first tensor argument of the
root's forward that holds a batch (positional, else keyword: ``pixel_values=``; never a scalar
such as the Trainer's ``num_items_in_batch``, a target or a mask; see batch_tensor), when it is
floating-point, reduced on its device when the root's forward starts, brought to the host with
the step's loss.

Every training forward pass (one with gradients): min and max (one ``aminmax``) and mean and
variance (one ``var_mean``), stacked: 3 ops, 4 numbers. On the CPU (unless fused_reductions),
where var_mean is a slow one-thread pass (300 us for 65,536 elements, measured), a plain step
takes the sum and the dot product of the elements less the first one instead (a subtraction, a
sum, a dot: ~35 us with the aminmax), and the host makes the mean and variance of them. On watched steps also the count of exact
zeros (``count_nonzero``), the share of NaN/Inf (counted only when the batch's min, max or mean is
NaN/Inf, which a finite batch never makes: no op otherwise), and, for a 2-D batch (samples x
features), each feature's standard
deviation over the batch (one ``std``, the first 4,096 features), from which the host counts the
constant features and the largest std over the smallest non-zero one. Taken over the first
samples, up to 65,536 elements on the CPU and 2M on a GPU (the whole batch of most jobs), as the
module statistics are.

What the analyzer reads from them: inputs never normalised (0..255 images, raw units), a
constant or all-zero batch, features of wildly different scales, a shift mid-run
(detectors/input_data.py). Integer inputs (token ids) have none: "not normalised" means nothing
for ids.
"""

from __future__ import annotations

import math

import torch

from ..probe import Probe, StepPlan
from ..reductions.fused import fused_here, stats_part

CPU_ELEMENTS, GPU_ELEMENTS = 1 << 16, 1 << 21
MAX_FEATURES = 4096  # per-feature stds brought to the host on a watched step
# The steps/ columns of InputStats.combine's row, in its order.
INPUT_COLUMNS = ("input_min", "input_max", "input_mean", "input_std", "input_zero_share", "input_nonfinite_share",
                 "input_constant_features", "input_std_ratio")
_NONE = (math.nan,) * 6 + (-1, math.nan)  # a step without a floating input
_WATCHED = 5  # numbers before the features' stds on a watched step
_DOT_DTYPES = (torch.float32, torch.float64)


_NOT_THE_BATCH = ("labels", "label", "targets", "target")  # keywords that are targets, not inputs


def batch_tensor(args, kwargs):
    """The tensor the model computes from: the first tensor among a forward's positional, then
    keyword, arguments that holds a batch (one dimension or more, more than one element), not a
    target (``labels=``) nor a mask (``attention_mask=``). Scalars are settings, not the batch:
    the Hugging Face Trainer passes ``num_items_in_batch`` as a 0-d tensor. It may be integer
    (token ids): statistics of a float batch do not apply to it, so none are taken."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.numel() > 1:
            return a
    for k, a in (kwargs or {}).items():
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.numel() > 1 \
                and k not in _NOT_THE_BATCH and not k.endswith("mask"):
            return a
    return None


class InputStats(Probe):
    def __init__(self, fused: bool | None = None):
        self.pending: list[torch.Tensor] = []  # one vector per training forward of this step
        self.watched = False  # this step takes the watched step's extra numbers
        self._shapes: list[tuple[int, int, int]] = []  # per vector: (its length, elements, features)
        self._taken: list[tuple[int, int, int]] = []
        self._last: torch.Tensor | None = None  # the watched step's last batch part, until combine()
        self.fused_option = fused  # (RecorderConfig.fused_reductions: the GPU's ops, anywhere)

    def arm(self, plan: StepPlan) -> None:
        self.watched = plan.watched  # (the batch's zero share and constant features too)

    def on_forward(self, args, kwargs) -> None:
        x = batch_tensor(args, kwargs)
        if x is None or not x.is_floating_point() or x.is_sparse:
            return
        with torch.no_grad():
            v = stats_part(x, CPU_ELEMENTS if x.device.type == "cpu" else GPU_ELEMENTS)
            lo, hi = torch.aminmax(v)
            if not self.watched and not fused_here(self.fused_option, v) and v.dtype in _DOT_DTYPES:
                # (shifted by the first element: the variance does not drown in the mean's square)
                flat = v.reshape(-1)
                d = flat - flat[0]
                self.pending.append(torch.stack([lo, hi, d.sum(), torch.dot(d, d), flat[0]]))
                self._shapes.append((-5, v.numel(), 0))  # (-5: sums; combine() makes the moments)
                return
            var, mean = torch.var_mean(v, correction=0)
            if not self.watched:
                self.pending.append(torch.stack([lo, hi, mean, var]))
                self._shapes.append((4, v.numel(), 0))
                return
            # (stack and cat promote: one dtype for the transfer)
            vec = torch.stack([lo, hi, mean, var, torch.count_nonzero(v)])
            self._last = v  # (its NaN/Inf counted in combine() if its statistics say it has any)
            features = 0
            if v.dim() == 2 and v.shape[0] >= 2:
                features = min(v.shape[1], MAX_FEATURES)
                vec = torch.cat([vec, v[:, :features].std(dim=0)])
            self.pending.append(vec)
            self._shapes.append((_WATCHED + features, v.numel(), features))

    def take(self) -> list[torch.Tensor]:
        """This step's vectors (combine() reads their host values)."""
        p, self.pending = self.pending, []
        self._taken, self._shapes = self._shapes, []
        return p

    def _nonfinite_share(self, row: list[float]) -> float:
        """The last watched batch's share of NaN/Inf: 0 unless its min, max or mean is not finite
        (then counted: a second transfer, on that step only)."""
        v, self._last = self._last, None
        if all(math.isfinite(x) for x in row[:3]) or v is None:
            return 0.0
        with torch.no_grad():
            return float((~torch.isfinite(v)).sum()) / max(1, v.numel())

    def put_back(self, pending: list[torch.Tensor]) -> None:
        self.pending, self._shapes, self._taken = pending, self._taken, []

    def pack(self, pk, plan: StepPlan) -> None:
        inputs = self.take()
        if inputs:
            pk.add("inputs", torch.cat(inputs))

    def combine(self, values) -> tuple:
        """The step's row (INPUT_COLUMNS) from the host values of take()'s vectors: the min of
        the forwards' mins, the max of their maxes, the mean of their means, the largest std, the
        last forward's zero and NaN/Inf shares and feature counts; NaN/-1 where not taken (a NaN
        anywhere in a field makes it NaN)."""
        values = [float(v) for v in values]
        shapes, self._taken = self._taken, []
        if not values or len(values) != sum(abs(n) for n, _, _ in shapes):
            self._last = None
            return _NONE
        rows, i = [], 0
        for n, numel, _ in shapes:
            row = values[i:i + abs(n)]
            i += abs(n)
            if n == -5:  # sums of (x - first): the mean and variance
                m1, m2 = row[2] / numel, row[3] / numel
                row = [row[0], row[1], row[4] + m1, max(m2 - m1 * m1, 0.0)]
            rows.append(row)
        lo, hi = _nan_or(min, [r[0] for r in rows]), _nan_or(max, [r[1] for r in rows])
        mean = sum(r[2] for r in rows) / len(rows)
        std = _nan_or(max, [math.sqrt(r[3]) if r[3] >= 0 else math.nan for r in rows])
        last, (n, numel, features) = rows[-1], shapes[-1]
        if n in (4, -5):
            self._last = None
            return lo, hi, mean, std, math.nan, math.nan, -1, math.nan
        zero, nonfinite = 1.0 - last[4] / numel, self._nonfinite_share(last)
        if not features:
            return lo, hi, mean, std, zero, nonfinite, -1, math.nan
        stds = last[_WATCHED:]
        positive = [s for s in stds if s > 0]
        ratio = max(positive) / min(positive) if positive else math.nan
        return lo, hi, mean, std, zero, nonfinite, sum(1 for s in stds if s == 0), ratio


def _nan_or(fn, xs: list[float]) -> float:
    return math.nan if any(x != x for x in xs) else fn(xs)
