"""Sharded parameters (FSDP2's ``fully_shard``, tensor parallelism): DTensors.

A reduction of a DTensor (a norm, a max) is a collective: every rank must join it, so one taken by
the recorder alone on one rank would hang the job, or add a collective to every step. The
recorder measures each rank's own shard instead, the local tensor, with no communication: its
norms are those of the shard, its snapshots and black box hold the shard. The trace says so per
parameter (``params/shards``: how many shards the whole parameter is split into), and the analyzer
combines the ranks' shards into whole-parameter figures (analyzer/trace/shards.py).
"""

from __future__ import annotations

import math
import operator
import sys

import torch

_GRAD = operator.attrgetter("grad")


def _dtensor():
    """The DTensor class, once the job has imported it (FSDP2's fully_shard and tensor
    parallelism do): no tensor can be one before. Importing it here would add ~0.5 s to every
    job's start (torch.distributed.tensor pulls in sympy)."""
    mod = sys.modules.get("torch.distributed.tensor") or sys.modules.get("torch.distributed._tensor")  # (torch < 2.4)
    return getattr(mod, "DTensor", None)


def is_sharded(t) -> bool:
    dtensor = _dtensor()
    return dtensor is not None and isinstance(t, dtensor)


def local(t):
    """The rank's own part of a DTensor (the tensor itself otherwise): the same storage, no copy,
    no communication."""
    if not is_sharded(t):
        return t
    inner = getattr(t, "_local_tensor", None)  # (the same object every call: identity checks hold)
    return inner if isinstance(inner, torch.Tensor) else t.to_local()


def local_grad(p):
    g = p.grad
    return local(g) if g is not None else None


def grad_getter(params) -> callable:
    """How the recorder reads a parameter's gradient: p.grad, or its shard's when any parameter
    is a DTensor (decided once: the common case stays a C attribute read)."""
    return local_grad if any(map(is_sharded, params)) else _GRAD


def shards(p) -> int:
    """Into how many shards the whole parameter is split (1: every rank holds all of it; a
    DTensor replicated on a mesh dimension is not split along it)."""
    if not is_sharded(p):
        return 1
    try:
        mesh, placements = p.device_mesh, p.placements
        return int(math.prod(mesh.size(d) for d, pl in enumerate(placements) if pl.is_shard()))
    except Exception:
        return 1


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the world size) of torch.distributed; (0, 1) when it is not in use."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
