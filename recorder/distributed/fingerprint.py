"""Replica fingerprints: a cheap, exact summary of each parameter's bits, every
``fingerprint_every`` steps, after the optimizer step.

Under data parallelism (DDP) every replica's parameters are bit-identical after each step; a rank
whose parameters differ is a silent corruption (a bad GPU) or a rank-dependent bug. The analyzer
compares the ranks' fingerprints and names the first step and rank where one left the others
(analyzer/cross_rank/divergence.py). No collective: each rank writes its own.

A parameter's fingerprint is the sum of its elements' bit patterns read as integers (float32 as
int32, bfloat16/float16 as int16, float64 as int64), summed in int64: integer addition is
associative, so the result does not depend on the kernel's order or the device, and any change of
one element changes it. One view and one reduction per parameter, on the device; the sums go to
the host in the step's one transfer, as three 24-bit pieces each (exact in float32)."""

from __future__ import annotations

import numpy as np
import torch

from ..probe import Probe, StepPlan
from .sharding import local

_AS_INT = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.int8}
_PIECE = 24
_MASK = (1 << _PIECE) - 1


def device_fingerprints(params: list) -> torch.Tensor:
    """One float32 vector of 3 pieces per parameter (see pieces_to_int64). Under torch.no_grad()
    (rec.step()'s work): views of the parameters themselves, no detach."""
    sums = []
    for p in params:
        t = local(p)
        if t.is_complex() or t.dtype == torch.bool or t.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=t.device))
            continue
        as_int = t.view(_AS_INT[t.element_size()]) if t.is_floating_point() else t
        sums.append(as_int.sum(dtype=torch.int64))
    if not sums:
        return torch.zeros(0)
    dev = sums[0].device
    s = torch.stack([x.to(dev) for x in sums])
    return torch.stack([s & _MASK, (s >> _PIECE) & _MASK, s >> (2 * _PIECE)], dim=1).reshape(-1).to(torch.float32)


def pieces_to_int64(host: np.ndarray) -> np.ndarray:
    """The int64 fingerprints from the host's pieces (low, middle, high; the high piece signed)."""
    p = np.asarray(host, dtype=np.float64).reshape(-1, 3).astype(np.int64)
    return p[:, 0] + (p[:, 1] << _PIECE) + (p[:, 2] << (2 * _PIECE))


class Fingerprints(Probe):
    """The probe: every ``every`` steps (0: never), the parameters' fingerprints."""

    def __init__(self, params: list, every: int):
        self._params = params
        self.every = every

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def pack(self, pk, plan: StepPlan) -> None:
        if self.due(plan.step) and self._params:
            pk.add("fingerprint", device_fingerprints(self._params))

    def rows(self, plan: StepPlan, host: dict) -> dict:
        if "fingerprint" not in host:
            return {}
        return {"fingerprints": {"step": plan.step, "bits": pieces_to_int64(host["fingerprint"])}}
