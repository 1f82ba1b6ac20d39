"""On-device reductions, and the one host transfer per step.

Everything here runs under ``torch.no_grad()`` on detached tensors: it reads the training's
tensors and never writes them, so the training computes exactly what it would without us.
"""

from __future__ import annotations

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
        self._parts.append(values.reshape(-1))

    def fetch(self) -> dict[str, np.ndarray]:
        if not self._parts:
            return {}
        try:
            vec = torch.cat(self._parts)  # promotes to a common dtype (float64 if any part is)
        except RuntimeError:  # parts on several devices (model parallel): gather on the first
            dev = self._parts[0].device
            vec = torch.cat([p.to(dev, torch.float64) for p in self._parts])
        # The one device->host copy of the step. On CUDA it synchronises, like loss.item().
        host = vec.to("cpu", torch.float64).numpy()
        out, i = {}, 0
        for name, part in zip(self._names, self._parts):
            out[name] = host[i:i + part.numel()]
            i += part.numel()
        return out


def floating_tensors(obj, limit: int = 8):
    """The floating-point tensors in a module's input or output (tensors, tuples, lists, dicts)."""
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
    return found


def activation_stats(x: torch.Tensor) -> torch.Tensor:
    """[numel, sum, sum of squares, zeros, non-finite] of one activation, on its device.

    Sufficient statistics rather than mean/std, so that several calls of one module in a step
    (RNN cells, shared blocks) combine exactly by addition. Sums accumulate in float64: in
    float32, sqrt(E[x^2] - mean^2) cancels catastrophically when |mean| >> std (measured:
    mean 1000, std 1 read 0.79). It costs ~0.07 ms per 131k elements on CPU, on sampled steps.
    """
    x = x.detach()
    f64 = torch.float64
    n = x.numel()
    return torch.stack([
        torch.tensor(float(n), dtype=f64, device=x.device),
        x.sum(dtype=f64),
        torch.linalg.vector_norm(x, 2, dtype=f64).square(),
        n - torch.count_nonzero(x).to(f64),
        # x - x is 0 where x is finite and NaN where it is NaN or +-Inf: counting its non-zeros
        # counts the non-finite elements, 3x faster than (~isfinite(x)).sum() (measured).
        torch.count_nonzero(x - x).to(f64),
    ])
