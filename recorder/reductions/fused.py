"""The reductions of a watched forward pass in a few foreach ops, whatever the number of modules.

A watched step checks every module's inputs and outputs for NaN/Inf and takes statistics of each
output. One reduction per tensor is ~12 ops per module (an ``aminmax``, a shifted sum, two dots,
their views and stacks): on a GPU each op is a kernel launch, and a launch-bound step paid 2-4x
(benchmarks/op_counts.py counts them). Fused, the hooks only register the tensors (WatchBatch),
and a flush reduces all of them at once: ``_foreach_max`` and ``_foreach_norm`` (ord inf for
max |x|; 2, 1 and the signs' 2 for the moments, accumulated in float64), a stack each, a fixed
number of ops; the results stay on the device until the step's one transfer.

The recorder fuses on a GPU. On the CPU, where an op costs no launch and the per-tensor
reductions are the fast ones (``_foreach_norm`` of ord inf, 1 or in float64 is 10-40x slower
there than a max or a float32 dot; measured), it keeps them, unless ``fused_reductions=True``
(how the benchmark and the tests count and check the GPU's path on the CPU).

A flush runs when the root module's forward returns (every checked tensor is still alive then:
the backward needs them), and before a module that writes into its input (``inplace=True``, or
seen doing it), so the input is measured as its producer returned it. A tensor written in place
after it was registered and before the flush (``out += identity`` in a parent's forward) is
*stale*: its values are no longer those its module returned, so it counts as not measured, and its
module is flushed as it returns from the next watched step on.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from .stats import activation_stats, max_and_absmax, stack_gathered

# Statistics (mean, std, zero share) of a fused step are taken over the first rows of an output
# holding at most this many elements (the finite check and max |x| see every element): the whole
# output of most layers (8 MB of float32: a few us of a GPU's memory bandwidth), the first
# samples of a bigger one. A slice is an op of its own (a view); foreach ops need no flattening.
# (The per-tensor path, stats.activation_stats, takes 2**16 elements: a CPU pays per element.)
STATS_MAX_ELEMENTS = 1 << 21


def fused_here(option: bool | None, tensor) -> bool:
    """Whether to fuse: as RecorderConfig.fused_reductions says, or (None) on a GPU."""
    return option if option is not None else tensor.device.type != "cpu"


def stats_part(x: torch.Tensor, limit: int = STATS_MAX_ELEMENTS) -> torch.Tensor:
    """x itself, or its first rows (or the first elements of its first row) up to `limit` elements."""
    if x.numel() <= limit:
        return x
    row = x.numel() // x.shape[0] if x.dim() > 1 and x.shape[0] else 0
    if 0 < row <= limit:
        return x[: limit // row]
    return x.reshape(-1)[:limit]


def _groups(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of the tensors by (device, dtype): a foreach op's fused path takes one of each."""
    out: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.device, t.dtype), []).append(i)
    return out


def maxima(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The max of each tensor, then the max |x| of each, in order, in one 1-D tensor (the widest
    dtype). A NaN makes both NaN; +Inf shows in the max, -Inf as an infinite max |x| with a
    finite max. (Results stacked once, split on the host: host_maxima.)"""
    top: list = [None] * len(tensors)
    mag: list = [None] * len(tensors)
    for idx in _groups(tensors).values():
        group = [tensors[i] for i in idx]
        for k, hi, m in zip(idx, torch._foreach_max(group), torch._foreach_norm(group, math.inf)):
            top[k], mag[k] = hi, m
    return stack_gathered(top + mag)


def moments(parts: list[torch.Tensor]) -> torch.Tensor:
    """Four float64 norms of each part, in one 1-D tensor: |x|_2, |max(x, 0)|_1, |x|_1 and
    |sign(x)|_2 of every part in turn, from which host_moments makes the sums combine_stats
    (stats.py) turns into mean, std and zero share: sum(x) = 2 |max(x, 0)|_1 - |x|_1, sum(x^2) =
    |x|_2^2, nonzero elements = |sign(x)|_2^2, accumulated in float64 (around 0: enough for any
    mean). sign(NaN) is 0, as in activation_stats: no zero share where the sums are NaN."""
    cols: list[list] = [[None] * len(parts) for _ in range(4)]
    f64 = torch.float64
    for idx in _groups(parts).values():
        group = [parts[i] for i in idx]
        norms = (torch._foreach_norm(group, 2, dtype=f64),
                 torch._foreach_norm(torch._foreach_clamp_min(group, 0.0), 1, dtype=f64),
                 torch._foreach_norm(group, 1, dtype=f64),
                 torch._foreach_norm(torch._foreach_sign(group), 2, dtype=f64))
        for col, values in zip(cols, norms):
            for k, v in zip(idx, values):
                col[k] = v
    return stack_gathered(cols[0] + cols[1] + cols[2] + cols[3])


def host_maxima(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max, max |x|) from maxima's values on the host."""
    n = len(values) // 2
    return values[:n], values[n:]


def host_moments(values: np.ndarray) -> np.ndarray:
    """(n x 4) rows (sum, sum of squares, nonzero elements, 0) from moments' values on the host,
    as activation_stats' rows (shifted by 0)."""
    l2, pos, l1, signs = values.astype(np.float64).reshape(4, -1)
    with np.errstate(invalid="ignore", over="ignore"):  # (Inf - Inf: NaN, as the sums would be)
        return np.stack([2 * pos - l1, l2 * l2, np.rint(signs * signs), np.zeros_like(l2)], axis=1)


class Measurements:
    """A step's finite checks and output statistics, in registration order: reduced per tensor at
    once (eager, the CPU's default), or registered and reduced a flush at a time (fused; see the
    module). Tensors already measured this step (the same object, unchanged since) are not again."""

    def __init__(self, fused: bool | None = None):
        self.fused_option = fused  # None: fused on a GPU
        self.reset()

    def reset(self) -> None:
        self.fused: bool | None = None  # decided by the step's first tensor
        self._seen: dict[int, tuple] = {}  # id -> (weakref, check index, version)
        self._stats_of: dict[int, tuple] = {}  # id -> (weakref, statistics row, version)
        self._mins: list[torch.Tensor] = []  # eager: one (min, max) pair per check
        self._maxs: list[torch.Tensor] = []
        self._stats: list[torch.Tensor] = []  # eager: activation_stats rows
        self.numel: list[int] = []  # elements of each statistics row's part
        self._pending: list[torch.Tensor] = []  # fused: registered, not yet flushed
        self._pending_parts: list[torch.Tensor] = []
        self._versions: list[int] = []  # fused: of each check's tensor when registered
        self._part_versions: list[int] = []
        self._owner: list[int] = []  # fused: the module whose output a check is (-1: an input)
        self.stale: list[bool] = []  # fused: written in place between registration and flush
        self.stale_parts: list[bool] = []
        self._maxima: list[tuple[torch.Tensor, torch.Tensor]] = []  # fused: one per flush
        self._moments: list[torch.Tensor] = []

    @property
    def empty(self) -> bool:
        return not self._seen

    def _mode(self, x: torch.Tensor) -> bool:
        if self.fused is None:
            self.fused = fused_here(self.fused_option, x)
        return self.fused

    def check(self, x: torch.Tensor, owner: int = -1) -> int:
        """Index of x's check (its max and max |x|), registering or computing it if new."""
        key, version = id(x), x._version
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is x and hit[2] == version:
            if owner >= 0 and self.fused:
                self._owner[hit[1]] = owner
            return hit[1]
        if self._mode(x):
            self._pending.append(x)
            self._versions.append(version)
            self._owner.append(owner)
            idx = len(self._versions) - 1
        else:
            mn, mx = torch.aminmax(x.detach())
            self._mins.append(mn)
            self._maxs.append(mx)
            idx = len(self._mins) - 1
        self._seen[key] = (weakref.ref(x), idx, version)
        return idx

    def stats_row(self, x: torch.Tensor) -> int:
        """Row of x's statistics (sums for its mean, std and zero share), computed once per tensor."""
        key, version = id(x), x._version
        hit = self._stats_of.get(key)
        if hit is not None and hit[0]() is x and hit[2] == version:
            return hit[1]
        if self._mode(x):
            p = x if x.numel() <= STATS_MAX_ELEMENTS else stats_part(x.detach())
            self._pending_parts.append(p)
            self._part_versions.append(version)
            self.numel.append(p.numel())
        else:
            row, n = activation_stats(x)
            self._stats.append(row)
            self.numel.append(n)
        self._stats_of[key] = (weakref.ref(x), len(self.numel) - 1, version)
        return len(self.numel) - 1

    def flush(self) -> set[int]:
        """Reduce the registered tensors (fused; call under no_grad). Returns the modules whose
        outputs were written in place since they returned (stale)."""
        stale: set[int] = set()
        if self._pending:
            base = len(self.stale)
            for k, x in enumerate(self._pending):
                bad = x._version != self._versions[base + k]
                self.stale.append(bad)
                if bad and self._owner[base + k] >= 0:
                    stale.add(self._owner[base + k])
            self._maxima.append(maxima(self._pending))
            self._pending = []
        if self._pending_parts:
            base = len(self.stale_parts)
            self.stale_parts.extend(p._version != self._part_versions[base + k]
                                    for k, p in enumerate(self._pending_parts))
            self._moments.append(moments(self._pending_parts))
            self._pending_parts = []
        return stale

    def pack(self, packer) -> set[int]:
        """Add the step's values to the step's one transfer (host_values reads them back);
        returns the stale modules of a last flush (fused)."""
        stale = self.flush() if self.fused else set()
        if self._mins:
            maxs, absmax = max_and_absmax(self._mins, self._maxs)
            packer.add("pair_max", maxs)
            packer.add("pair_absmax", absmax)
        if self._stats:
            dev = self._stats[0].device
            packer.add("acts", [t.to(dev) for t in self._stats])
        for k, m in enumerate(self._maxima):  # fused: each flush's values as they are (no cat)
            packer.add(f"maxima{k}", m)
        for k, m in enumerate(self._moments):
            packer.add(f"moments{k}", m)
        return stale

    def host_values(self, host: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(max, max |x|) of every check and the statistics rows (sum, sum of squares, nonzero,
        shift), from the step's transfer."""
        if not self.fused:
            acts = host["acts"].reshape(-1, 4) if "acts" in host else None
            return host.get("pair_max", np.zeros(0)), host.get("pair_absmax", np.zeros(0)), acts
        pairs = [host_maxima(host[f"maxima{k}"]) for k in range(len(self._maxima))]
        maxs = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0)
        absmax = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0)
        acts = [host_moments(host[f"moments{k}"]) for k in range(len(self._moments))]
        return maxs, absmax, (np.concatenate(acts) if acts else None)
