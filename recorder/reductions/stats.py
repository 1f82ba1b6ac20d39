"""On-device reductions, and the one host transfer per step.

Everything here runs under ``torch.no_grad()`` on detached tensors: it reads the training's
tensors and never writes them, so the training computes exactly what it would without us.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np
import torch


class Packer:
    """Collects named 1-D device tensors during a step and moves them to the host in one copy."""

    def __init__(self):
        self._names: list[str] = []
        self._parts: list[torch.Tensor] = []

    def add(self, name: str, values) -> None:
        if isinstance(values, (list, tuple)):
            values = torch.stack(values) if values else torch.zeros(0)
        self._names.append(name)
        self._parts.append(values if values.dim() == 1 else values.reshape(-1))

    @property
    def empty(self) -> bool:
        return not self._parts

    def fetch(self) -> dict[str, np.ndarray]:
        if not self._parts:
            return {}
        if len(self._parts) == 1:  # often just the loss
            return {self._names[0]: _host(self._parts[0])}
        try:
            vec = torch.cat(self._parts)  # promotes to a common dtype (float64 if any part is)
        except RuntimeError:  # parts on several devices (model parallel): gather on the first
            dev = self._parts[0].device
            vec = torch.cat([p.to(dev, torch.float64) for p in self._parts])
        # The one device->host copy of the step. On CUDA it synchronises, like loss.item().
        host = _host(vec)
        out, i = {}, 0
        for name, part in zip(self._names, self._parts):
            out[name] = host[i:i + part.numel()]
            i += part.numel()
        return out


# On the CPU with several intra-op threads, a list of tensors averaging at least this many
# elements gets one BLAS dot per tensor in l2_norms; a list of smaller ones one _foreach_norm.
DOT_MEAN_ELEMENTS = 1 << 15
# Past 2**31 elements (BLAS's 32-bit lengths) torch's dot falls back to a plain one-thread loop.
_DOT_MAX_ELEMENTS = (1 << 31) - 1
_DOT_DTYPES = {torch.float32, torch.float64}
_IS_CPU = operator.attrgetter("is_cpu")
_DTYPE = operator.attrgetter("dtype")


def l2_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor, one 1-D tensor: torch.stack(torch._foreach_norm(tensors)),
    faster on a CPU with several threads.

    There _foreach_norm runs on one thread, and right after a backward pass the gradients come
    mostly from memory: one multi-threaded BLAS dot per tensor, square roots after, is faster
    for large tensors (2 threads, first call after the backward, plus the optimizer step after
    it, medians: benchmarks/'s MLP 1.22 against 1.26 ms, the transformer 4.84 against 4.96 ms;
    the CNN's small tensors 0.59 with _foreach_norm against 0.64 ms; one thread: _foreach_norm
    by 0.02-0.05 ms; measured). Either way, all tensors take one path: right after a training
    step every further kind of op costs 20-50 us the first time (measured), so mixing the two
    (a dot for the large tensors, _foreach_norm for the rest, put back in order) was slower than
    both. The dot is also the more accurate float32 sum (relative error 8e-5 against 6e-4 for
    16M elements, measured); both overflow to Inf above ~1.8e19, which the recorder recomputes
    in float64. CUDA, other dtypes and non-contiguous tensors: _foreach_norm."""
    if not tensors:
        return torch.zeros(0)
    if _takes_dots(tensors):
        return torch.stack([torch.dot(v, v) for v in (t.view(-1) for t in tensors)]).sqrt_()
    return _stack(torch._foreach_norm(tensors))


def l2_norm_values(tensors: list[torch.Tensor], dots: bool | None = None, one_transfer: bool | None = None) -> list[float]:
    """The norms of l2_norms as Python floats, for the host at once (the optimizer step
    pre-hook). On the CPU each is read with .item(): right after a training step the stack,
    sqrt_ and tolist of l2_norms cost more than the reads (over the optimizer step after it,
    paired, medians: MLP +0.18 against +0.25 ms with the dots, CNN +0.13 against +0.18 with
    _foreach_norm; measured), and the square roots are taken in float64. On a GPU .item() would
    synchronise once per tensor: there, one transfer.

    `dots`: the path, if the caller chose it already (the pre-hook, once per optimizer: each
    pass of _takes_dots over the tensors costs a few us, cold); a tensor it does not suit (a
    None, a sparse one) raises. `one_transfer`: True takes the GPU's path anywhere (one
    _foreach_norm, one transfer); None decides by the device."""
    if not tensors:
        return []
    if one_transfer:
        return _stack(torch._foreach_norm(tensors)).tolist()
    if dots if dots is not None else _takes_dots(tensors):
        return [math.sqrt(torch.dot(v, v).item()) for v in (t.reshape(-1) for t in tensors)]
    norms = torch._foreach_norm(tensors)
    if all(map(_IS_CPU, norms)):
        return [n.item() for n in norms]
    return _stack(norms).tolist()


def takes_dots(tensors: list[torch.Tensor]) -> bool:
    """Whether l2_norms and l2_norm_values take a BLAS dot per tensor (see _takes_dots)."""
    return bool(tensors) and _takes_dots(tensors)


def _takes_dots(tensors: list[torch.Tensor]) -> bool:
    """Whether l2_norms takes a BLAS dot per tensor: several threads, CPU, float32/float64,
    contiguous, large on average. (The checks run as map()s in C: each pass over the tensors
    costs a few us, cold.)"""
    if torch.get_num_threads() <= 1:
        return False
    sizes = list(map(torch.Tensor.numel, tensors))
    return (sum(sizes) >= DOT_MEAN_ELEMENTS * len(sizes) and max(sizes) <= _DOT_MAX_ELEMENTS
            and all(map(_IS_CPU, tensors)) and set(map(_DTYPE, tensors)) <= _DOT_DTYPES
            and all(map(torch.Tensor.is_contiguous, tensors)))


def _stack(norms: list[torch.Tensor]) -> torch.Tensor:
    return stack_gathered(norms, torch.float32)


def stack_gathered(values: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.stack(values); for a model spread over devices, gathered on the first one first
    (as ``dtype``, or each its own: the stack promotes)."""
    try:
        return torch.stack(values)
    except RuntimeError:  # values on several devices (model parallel)
        return torch.stack([v.to(values[0].device, dtype) for v in values])


def max_and_absmax(mins: list[torch.Tensor], maxs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, max |x|) of tensors from their aminmax results: max |x| = max(max, -min), NaN
    staying NaN."""
    top = torch.stack(maxs)
    return top, torch.maximum(top, torch.stack(mins).neg())


def _host(t: torch.Tensor) -> np.ndarray:
    """float64 numpy copy of a tensor: a row queued for the writer must hold no torch tensor
    (the live-tensor census would count it as the job's)."""
    return np.array(t.to("cpu", torch.float64).numpy(), copy=True)


def floating_tensors(obj, limit: int = 8):
    """The floating-point tensors in a module's input or output (tensors, tuples, lists, dicts,
    dataclasses; None and other values skipped), the first `limit`."""
    if isinstance(obj, torch.Tensor):  # the common cases first: one tensor, or a 1-tuple of one
        obj = (obj,)
    if type(obj) is tuple and len(obj) == 1 and isinstance(obj[0], torch.Tensor):
        x = obj[0]
        return [x] if x.is_floating_point() and x.numel() > 0 and not x.is_sparse else []
    found = []
    stack = [obj]
    while stack and len(found) < limit:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.numel() > 0 and not x.is_sparse:
                found.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):  # (a ModelOutput is a dict already)
            stack.extend(reversed([getattr(x, f.name, None) for f in dataclasses.fields(x)]))
    return found


# Activation statistics are taken over the first rows (dim 0: the batch) of an output holding at
# most this many elements: the mean, std and zero share of a layer are those of a few samples of
# the batch (65,536 values: the standard error of a mean is 0.4% of the std), and a big
# convolution output (64x32x32x32, 2M elements) costs ~0.04 ms, not ~1.4 ms. 2**18 cost the
# MLP of benchmarks/ (outputs of 131,072 elements) ~1 ms more on each watched step, on one core
# (measured). The finite check and max |x| still see every element.
STATS_MAX_ELEMENTS = 1 << 16


def stats_part(x: torch.Tensor, limit: int = STATS_MAX_ELEMENTS) -> torch.Tensor:
    """The first rows of x (or of its first row) with at most `limit` elements, flat."""
    if x.numel() <= limit:
        return x.reshape(-1)
    if x.dim() > 1 and x[0].numel() <= limit:
        return x[: limit // x[0].numel()].reshape(-1)
    return (x.reshape(-1) if x.is_contiguous() else x[0].reshape(-1))[:limit]


def activation_stats(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """([sum of (p - c), sum of (p - c)^2, nonzero elements, c], numel of p) of the part p of an
    activation the statistics are taken over (stats_part), on its device, with c = its first
    element.

    Shifted sums, in float32: the variance is computed from sums around a value of the tensor
    itself, so it does not cancel when |mean| >> std (unshifted float32 sums read std 0.79 for
    mean 1000, std 1; measured), and float32 reductions cost a third of float64 ones on CPU
    (~120 us per 131k elements on one core, against ~320 us; measured). Several calls of one
    module in a step combine exactly on the host (combine_stats). Run on watched steps only.

    Nonzero elements from s = sign(p) (0 for +-0, +-1 else), as the dot of s with itself for
    float32 and float64: a comparison (p != 0) writes bools at ~0.5 ns per element on CPU, 4x
    slower than a sign and a dot (65,536 elements: ~35 against ~10 us on one core; measured).
    Exact (sums of ones below 2**24). sign(NaN) is 0: combine_stats gives no zero share where the
    sums went NaN.
    """
    p = stats_part(x.detach())
    c = p[0]
    d = p - c
    s = p.sign()
    if p.dtype == torch.float32 or p.dtype == torch.float64:
        row = torch.stack([d.sum(), torch.dot(d, d), torch.dot(s, s), c])
        return (row if p.dtype == torch.float32 else row.float()), p.numel()
    return torch.stack([  # float16, bfloat16: float32 sums
        d.sum(dtype=torch.float32),
        torch.linalg.vector_norm(d, dtype=torch.float32).square(),
        s.abs().sum(dtype=torch.float32),
        c.float(),
    ]), p.numel()


def combine_stats(n_modules: int, calls: dict[int, list[int]], numel: np.ndarray,
                  rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, std, zero share) of each module's output over its calls this step (NaN for a
    module without one), from rows of activation_stats and their element counts: `calls` maps a
    module to its rows. Chan et al.'s pairwise combination in float64, for every module at once
    (a call per module cost ~50 us of numpy: ~1 ms a watched step for the MLP of benchmarks/)."""
    module = np.fromiter((m for m, rs in calls.items() for _ in rs), dtype=np.int64)
    which = np.fromiter((r for rs in calls.values() for r in rs), dtype=np.int64)
    n = numel.astype(np.float64)[which]
    s, ss, nonzero, c = rows[which].astype(np.float64).T
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_k = c + s / n
        m2_k = np.maximum(ss - s * s / n, 0.0)  # sum of squared deviations from each call's mean
        total = np.bincount(module, n, n_modules)
        mean = np.bincount(module, n * mean_k, n_modules) / total
        m2 = np.bincount(module, m2_k + n * (mean_k - mean[module]) ** 2, n_modules)
        std = np.sqrt(m2 / np.maximum(total - 1, 1))
        zero = np.bincount(module, n - nonzero, n_modules) / total
        zero[np.isnan(mean)] = np.nan  # (a NaN element counted as zero by sign(); see activation_stats)
    called = total > 0
    return (np.where(called, mean, np.nan), np.where(called, std, np.nan), np.where(called, zero, np.nan))
