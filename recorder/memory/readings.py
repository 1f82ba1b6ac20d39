"""Per-step memory readings that cost no device synchronisation.

Resident memory is read the cheapest way each platform has (RSS_SOURCE names it, and the trace
keeps that name): Linux /proc/self/statm (now); macOS the Mach task's basic info (now);
Windows the working set from GetProcessMemoryInfo (now); elsewhere getrusage's ru_maxrss, the
peak so far (kilobytes on Linux and the BSDs, bytes on macOS); -1 ("not measured") where none
works. No POSIX-only module is needed to import this (resource is optional).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import sys

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_HAS_PROC = os.path.exists("/proc/self/statm") and hasattr(os, "pread")


_statm: int | None = None  # fd of this process's /proc/<pid>/statm, kept open


def _forget_statm() -> None:
    """In a forked child: the inherited fd reads the parent's statm; open the child's own."""
    global _statm
    if _statm is not None:
        try:
            os.close(_statm)
        except OSError:
            pass
    _statm = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_statm)


def _rss_statm() -> int:
    """Linux. /proc/<pid>/statm stays open and is re-read with pread: one system call a step.
    An open() and close() per step cost ~50 us more, right after a training step, and a
    getpid() per step to notice a fork (now an at-fork handler) a few us (measured)."""
    global _statm
    if _statm is None:
        _statm = os.open(f"/proc/{os.getpid()}/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    return int(os.pread(_statm, 128, 0).split()[1]) * _PAGE


def _mach_reader():
    """macOS: task_info(mach_task_self(), MACH_TASK_BASIC_INFO) as a function, or None.

    struct mach_task_basic_info (packed to 4 bytes): virtual_size, resident_size,
    resident_size_max (uint64 each), user_time, system_time (2 x int32 each), policy,
    suspend_count (int32): 12 words; resident_size is bytes 8-16."""
    libc = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
    task = ctypes.c_uint32.in_dll(libc, "mach_task_self_").value  # what mach_task_self() returns
    task_info = libc.task_info
    task_info.argtypes = [ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    task_info.restype = ctypes.c_int
    info, count = (ctypes.c_uint32 * 12)(), ctypes.c_uint32(12)
    MACH_TASK_BASIC_INFO = 20

    def read() -> int:
        count.value = 12
        if task_info(task, MACH_TASK_BASIC_INFO, info, ctypes.byref(count)) != 0:  # KERN_SUCCESS
            return -1
        return info[2] | (info[3] << 32)

    return read


def _windows_reader():
    """Windows: the working set (PROCESS_MEMORY_COUNTERS.WorkingSetSize) as a function, or None."""
    from ctypes import wintypes

    class Counters(ctypes.Structure):
        _fields_ = [("cb", wintypes.DWORD), ("PageFaultCount", wintypes.DWORD)] + [
            (n, ctypes.c_size_t) for n in ("PeakWorkingSetSize", "WorkingSetSize", "QuotaPeakPagedPoolUsage",
                                           "QuotaPagedPoolUsage", "QuotaPeakNonPagedPoolUsage",
                                           "QuotaNonPagedPoolUsage", "PagefileUsage", "PeakPagefileUsage")]

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    kernel32.GetCurrentProcess.restype = wintypes.HANDLE
    get = kernel32.K32GetProcessMemoryInfo  # (psapi's GetProcessMemoryInfo, in kernel32 since Windows 7)
    get.argtypes = [wintypes.HANDLE, ctypes.POINTER(Counters), wintypes.DWORD]
    get.restype = wintypes.BOOL
    process, counters = kernel32.GetCurrentProcess(), Counters()
    counters.cb = ctypes.sizeof(Counters)

    def read() -> int:
        return int(counters.WorkingSetSize) if get(process, ctypes.byref(counters), counters.cb) else -1

    return read


def _peak_reader():
    """Elsewhere: getrusage's ru_maxrss, the peak resident memory so far (not now)."""
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kilobytes on Linux and the BSDs

    def read() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    return read


def _choose():
    """(reader, name): the first that works here, tried once at import."""
    if _HAS_PROC:
        return _rss_statm, "statm"
    tries = []
    if sys.platform == "darwin":
        tries.append((_mach_reader, "mach_task_basic_info"))
    if sys.platform == "win32":
        tries.append((_windows_reader, "working_set"))
    tries.append((_peak_reader, "ru_maxrss_peak"))
    for make, name in tries:
        try:
            read = make()
            if read() > 0:
                return read, name
        except Exception:  # (ImportError, OSError, AttributeError: not on this platform)
            continue
    return (lambda: -1), "none"


_read_rss, RSS_SOURCE = _choose()


def rss_bytes() -> int:
    """Resident memory of this process now, in bytes (the peak where only that can be read,
    -1 where nothing can: RSS_SOURCE says which)."""
    return _read_rss()


def cuda_bytes(device: torch.device | None) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated) of the CUDA caching allocator, or -1s without CUDA.

    These are host-side counters of the allocator: reading them does not synchronise the GPU.
    One read of the allocator's nested stats (~25 us): torch.cuda.memory_allocated() and its
    siblings each flatten the whole dict of ~160 counters in Python, ~0.15 ms a call (measured
    on an H100 host, three of them were ~0.45 ms of a 2.5 ms training step).
    """
    if device is None or device.type != "cuda":
        return -1, -1, -1
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:  # CUDA not initialised yet: nothing allocated
        return 0, 0, 0
    allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
    return allocated["current"], reserved["current"], allocated["peak"]


# Groups kept per census: the largest by bytes and the most numerous (a leak of small tensors,
# such as one kept loss per step, grows in count long before it shows in bytes).
CENSUS_GROUPS_BY_BYTES = 24
CENSUS_GROUPS_BY_COUNT = 8


def live_instances(*roots: type, skip: str = "\0") -> list:
    """The objects the garbage collector tracks whose class is one of ``roots`` or a subclass
    of one defined so far, but classes of modules starting with ``skip``.

    type(), not isinstance(): some objects (torch.distributed.reduce_op) warn when their
    __class__ is looked up, and a scan must not print into the user's job. The filter runs in C
    (map, compress): a Python loop over the ~290,000 objects of the MLP benchmark's process took
    68 ms in all, against 48 (measured); each object's header is still read once."""
    types: set[type] = set()
    todo = list(roots)
    while todo:
        t = todo.pop()
        if t not in types and not str(t.__module__).startswith(skip):
            types.add(t)
            todo.extend(type.__subclasses__(t))
    objs = gc.get_objects()
    return list(itertools.compress(objs, map(types.__contains__, map(type, objs))))


def tensor_census() -> tuple[int, int, int, list[dict]]:
    """(live tensors, their storage bytes, how many hold an autograd graph, groups), from gc.

    Walks every object the garbage collector tracks: costs ~10-100 ms, so it runs sparsely.
    Storages shared by several tensors (views) are counted once. Groups are (device, dtype,
    shape, holds a graph, the graph's last op) with their count and bytes: the largest and the most numerous.
    """
    n = with_graph = nbytes = 0
    storages: set[tuple[str, int]] = set()
    groups: dict[tuple, list[int]] = {}
    # The compiler's own tensors (FakeTensor, FunctionalTensor: torch._subclasses) hold no memory,
    # and their data_ptr() makes torch warn: a compiled graph keeps some alive.
    tensors = live_instances(torch.Tensor, skip="torch._subclasses")
    for obj in tensors:
        n += 1
        try:
            graph = obj.grad_fn is not None
            with_graph += graph
            st = obj.untyped_storage()
            key = (str(obj.device), st.data_ptr())
            size = 0
            if key not in storages:
                storages.add(key)
                size = st.nbytes()
                nbytes += size
            g = groups.setdefault((str(obj.device), str(obj.dtype).replace("torch.", ""),
                                   tuple(obj.shape), graph, type(obj.grad_fn).__name__ if graph else ""), [0, 0])
            g[0] += 1
            g[1] += size
        except Exception:  # sparse, meta or otherwise storage-less tensors
            continue
    by_bytes = sorted(groups.items(), key=lambda kv: -kv[1][1])[:CENSUS_GROUPS_BY_BYTES]
    by_count = sorted(groups.items(), key=lambda kv: -kv[1][0])[:CENSUS_GROUPS_BY_COUNT]
    kept = dict(by_bytes + by_count)
    rows = [{"device": k[0], "dtype": k[1], "shape": "[" + ", ".join(map(str, k[2])) + "]",
             "graph": int(k[3]), "count": v[0], "bytes": v[1], "grad_fn": k[4]} for k, v in kept.items()]
    return n, nbytes, with_graph, rows
