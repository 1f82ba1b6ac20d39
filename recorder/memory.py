"""Per-step memory readings that cost no device synchronisation."""

from __future__ import annotations

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
