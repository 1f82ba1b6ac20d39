"""Per-step memory readings that cost no device synchronisation."""

from __future__ import annotations

import gc
import os
import resource
import sys

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_HAS_PROC = os.path.exists("/proc/self/statm")


def rss_bytes() -> int:
    """Resident set size of this process now (Linux), else its peak (macOS, BSD)."""
    if _HAS_PROC:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cuda_bytes(device: torch.device | None) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated) of the CUDA caching allocator, or -1s without CUDA.

    These are host-side counters of the allocator: reading them does not synchronise the GPU.
    """
    if device is None or device.type != "cuda":
        return -1, -1, -1
    return (
        torch.cuda.memory_allocated(device),
        torch.cuda.memory_reserved(device),
        torch.cuda.max_memory_allocated(device),
    )


def tensor_census() -> tuple[int, int, int]:
    """(live tensors, their storage bytes, how many hold an autograd graph), from gc's objects.

    Walks every object the garbage collector tracks: costs ~10-100 ms, so it runs sparsely.
    Storages shared by several tensors (views) are counted once.
    """
    n = with_graph = nbytes = 0
    storages: set[tuple[str, int]] = set()
    tensor = torch.Tensor
    for obj in gc.get_objects():
        # type(), not isinstance(): some objects (torch.distributed.reduce_op) warn when their
        # __class__ is looked up, and a census must not print into the user's job.
        if not issubclass(type(obj), tensor):
            continue
        n += 1
        try:
            if obj.grad_fn is not None:
                with_graph += 1
            st = obj.untyped_storage()
            key = (str(obj.device), st.data_ptr())
            if key not in storages:
                storages.add(key)
                nbytes += st.nbytes()
        except Exception:  # sparse, meta or otherwise storage-less tensors
            continue
    return n, nbytes, with_graph
