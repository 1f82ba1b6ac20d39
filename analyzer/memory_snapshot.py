"""CUDA allocator snapshots read back from a trace: the snapshot dict rebuilt (for PyTorch's
memory viewer), and what held the memory — live blocks grouped by the place that allocated them.

A snapshot is stored as rows (recorder/memory/cuda_allocator.py, docs/trace_format.md); nothing here
unpickles anything. ``snapshot_dict`` rebuilds exactly the dict ``torch.cuda.memory._snapshot()``
returned (the keys it had, plain Python ints, strings, lists and dicts), which
``torchautopsy export --memory-snapshot`` pickles for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import pickle

import numpy as np

from .errors import TraceFormatError
from .trace import RankTrace
from .trace.format import parse_json

# The optional keys of each entity, in the order of the bits of its `keys` column (the recorder's
# memory/cuda_allocator.py defines the same tuples; the trace format documents them).
SNAPSHOT_KEYS = ("device_traces", "allocator_settings")
SEGMENT_KEYS = ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks")
BLOCK_KEYS = ("address", "size", "requested_size", "state", "frames")
TRACE_KEYS = ("action", "addr", "device_free", "size", "stream", "time_us", "frames",
              "compile_context", "user_metadata")
FRAME_KEYS = ("filename", "line", "name")
# torch's device index (c10::DeviceIndex) is an int8: a process sees at most 128 devices. A
# snapshot claiming more device histories is damaged; the bound keeps a count like 2**40 from
# allocating lists without end (an empty history costs nothing in the file, so the file's size
# cannot bound it).
MAX_DEVICES = 1024
# Deeper than any snapshot torch writes (about 5 levels); JSON kept by the recorder could nest more.
MAX_DEPTH = 64


def _has(mask: int, keys: tuple[str, ...]) -> list[str]:
    return [k for i, k in enumerate(keys) if mask >> i & 1]


def _with_extra(d: dict, extra: str) -> dict:
    """Add the keys the recorder kept as JSON (ones it has no column for); unreadable JSON is skipped."""
    if extra:
        other = parse_json(extra)
        if isinstance(other, dict):
            d.update(other)
    return d


def _frames(rt: RankTrace, stack: int, cache: dict | None = None) -> list[dict]:
    """The frames of a stack as the snapshot had them. With ``cache``, each stack's list is built
    once and shared by every entry that has it (equal to torch's per-entry copies, and pickled
    once): a history of 10**6 entries on one deep stack stays small."""
    if cache is not None and stack in cache:
        return cache[stack]
    out = []
    for fr in rt.memory_stack(int(stack)) or []:
        d = {k: (int(fr[k]) if k == "line" else fr[k]) for k in _has(fr["keys"], FRAME_KEYS)}
        out.append(_with_extra(d, fr.get("extra", "")))
    if cache is not None:
        cache[stack] = out
    return out


def pick_snapshot(rt: RankTrace, which: str | int | None) -> int:
    """The snapshot number for ``which``: a number, ``last``, ``peak`` (most allocated) or
    ``oom`` (the first taken when memory ran out); default: the OOM one if any, else the last."""
    snaps = rt.memory_snapshots
    if not len(snaps):
        raise TraceFormatError(f"{rt.path} holds no CUDA memory snapshots (they are recorded on CUDA "
                               "models only, by torchautopsy 0.1.0 or later)")
    numbers = [int(x) for x in snaps["snapshot"]]
    if which is None:
        oom = snaps[snaps["reason"].isin(["oom", "exception"])]
        return int(oom["snapshot"].iloc[0]) if len(oom) else numbers[-1]
    if which == "last":
        return numbers[-1]
    if which == "peak":
        return int(snaps["snapshot"].iloc[int(np.argmax(snaps["allocated_bytes"].to_numpy()))])
    if which == "oom":
        oom = snaps[snaps["reason"].isin(["oom", "exception"])]
        if not len(oom):
            raise TraceFormatError(f"{rt.path} has no snapshot taken when memory ran out")
        return int(oom["snapshot"].iloc[0])
    try:
        n = int(which)
    except (TypeError, ValueError):
        raise TraceFormatError(f"no memory snapshot {which!r}: give a number, last, peak or oom") from None
    if n not in numbers:
        raise TraceFormatError(f"{rt.path} has no memory snapshot {n} (snapshots: "
                               f"{', '.join(map(str, numbers[:20]))}{' ...' if len(numbers) > 20 else ''})")
    return n


def snapshot_dict(rt: RankTrace, snapshot: int) -> dict:
    """The snapshot as ``torch.cuda.memory._snapshot()`` returned it (the keys it had)."""
    snaps = rt.memory_snapshots
    row = snaps[snaps["snapshot"] == snapshot]
    if row.empty:
        raise TraceFormatError(f"{rt.path} has no memory snapshot {snapshot}")
    row = row.iloc[0]
    n_devices = int(row["n_device_traces"])
    if not 0 <= n_devices <= MAX_DEVICES:
        raise TraceFormatError(f"{rt.path}: memory snapshot {snapshot} claims {n_devices:,} device histories "
                               f"(a process sees at most {MAX_DEVICES:,} devices); the trace is damaged")
    t = rt.memory_snapshot_rows(snapshot)
    stacks: dict[int, list[dict]] = {}
    blocks_by_seg: dict[int, list[dict]] = {}
    for b in t["blocks"].itertuples(index=False):
        d = {}
        for k in _has(int(b.keys), BLOCK_KEYS):
            d[k] = (_frames(rt, int(b.stack), stacks) if k == "frames"
                    else str(b.state) if k == "state" else int(getattr(b, k)))
        blocks_by_seg.setdefault(int(b.segment), []).append(_with_extra(d, b.extra))
    segments = []
    for i, s in enumerate(t["segments"].itertuples(index=False)):
        d = {}
        for k in _has(int(s.keys), SEGMENT_KEYS):
            if k == "segment_pool_id":
                d[k] = (int(s.pool_a), int(s.pool_b))
            elif k == "is_expandable":
                d[k] = bool(s.is_expandable)
            elif k == "segment_type":
                d[k] = str(s.segment_type)
            elif k == "frames":
                d[k] = _frames(rt, int(s.stack), stacks)
            elif k == "blocks":
                d[k] = blocks_by_seg.get(i, [])
            else:
                d[k] = int(getattr(s, k))
        segments.append(_with_extra(d, s.extra))
    out: dict = {"segments": segments}
    mask = int(row["keys"])
    if mask & 1:
        traces: list[list[dict]] = [[] for _ in range(n_devices)]
        for e in t["trace"].itertuples(index=False):
            d = {}
            for k in _has(int(e.keys), TRACE_KEYS):
                if k == "frames":
                    d[k] = _frames(rt, int(e.stack), stacks)
                elif k in ("action", "compile_context", "user_metadata"):
                    d[k] = str(getattr(e, k))
                else:
                    d[k] = int(getattr(e, k))
            if 0 <= int(e.device) < len(traces):
                traces[int(e.device)].append(_with_extra(d, e.extra))
        out["device_traces"] = traces
    if mask & 2:
        out["allocator_settings"] = parse_json(row["allocator_settings"], {}) if row["allocator_settings"] else {}
    return _with_extra(out, row["extra"])


def plain(obj, depth: int = 0, memo: dict | None = None):
    """``obj`` rebuilt from plain types only: str, int, float, bool, None, list, dict, and tuple
    (torch's own snapshot has tuples; like lists they pickle without naming any class). numpy
    scalars and arrays become Python numbers and lists, bytes become str; anything else, or
    nesting deeper than MAX_DEPTH, raises TypeError. Pickling the result can make ``pickle.load``
    create nothing but these types, whatever the trace held. Shared lists and dicts stay shared."""
    t = type(obj)
    if obj is None or t in (str, int, float, bool):
        return obj
    if isinstance(obj, np.generic):  # np.float64 and np.str_ subclass float and str: test first
        return plain(obj.item(), depth, memo)
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).decode("utf-8", "replace")
    for base in (str, int, float):  # subclasses (IntEnum, ...) pickle by their class's name
        if isinstance(obj, base) and type(base(obj)) is base:
            return base(obj)
    if depth >= MAX_DEPTH:
        raise TypeError(f"a memory snapshot nested deeper than {MAX_DEPTH} levels")
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, np.ndarray):
        return plain(obj.tolist(), depth, memo)
    if isinstance(obj, dict):
        out: dict = {}
        memo[id(obj)] = out
        for k, v in obj.items():
            key = plain(k, depth + 1, memo)
            if type(key) not in (str, int, float, bool) and key is not None:
                raise TypeError(f"a memory snapshot key of type {type(k).__name__}")
            out[key] = plain(v, depth + 1, memo)
        return out
    if isinstance(obj, list):
        new: list = []
        memo[id(obj)] = new
        new.extend(plain(v, depth + 1, memo) for v in obj)
        return new
    if isinstance(obj, tuple):
        memo[id(obj)] = result = tuple(plain(v, depth + 1, memo) for v in obj)
        return result
    raise TypeError(f"a memory snapshot holds a {t.__name__}, which is not a plain type")


def snapshot_pickle(rt: RankTrace, snapshot: int) -> bytes:
    """The pickle ``torch.cuda.memory._dump_snapshot()`` would have written, built from plain
    types only (``plain``), for https://pytorch.org/memory_viz. Never read by torchautopsy."""
    try:
        return pickle.dumps(plain(snapshot_dict(rt, snapshot)))
    except (TypeError, ValueError, OverflowError) as e:  # a damaged value (a count of the wrong type, ...)
        why = " ".join(str(e).split())[:200]
        raise TraceFormatError(f"{rt.path}: memory snapshot {snapshot} cannot be rebuilt ({why}); "
                               "the trace is damaged") from None


# -- what held the memory ------------------------------------------------------------------------

def is_library(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return ("/torch/" in f or "/site-packages/" in f or "/dist-packages/" in f or f.startswith("<")
            or "/torchautopsy/" in f)


# Frames looked through for the job's own code: a real stack has tens; a trace's may claim 20,000.
SITE_SCAN = 256


def _frame_text(fr: dict) -> str:
    return f"{fr.get('filename', '?')}:{fr.get('line', '?')} in {fr.get('name', '?')}"


def site_of(frames: list[dict] | None, depth: int = 6) -> tuple[str, list[str]]:
    """(the allocation site: innermost frame in the job's own code among the first SITE_SCAN,
    "file:line in function"; the stack, innermost first, at most `depth` frames) of a recorded
    stack."""
    if not frames:
        return "(no stack recorded)", []
    text = [_frame_text(fr) for fr in frames[:depth]]
    for fr in frames[:SITE_SCAN]:
        if not is_library(str(fr.get("filename", ""))):
            return _frame_text(fr), text
    return text[0], text


def _group(rt: RankTrace, items: list[tuple[int, int]], top: int) -> list[dict]:
    """[(stack, bytes)] grouped by allocation site, largest first; each stack read once (a
    snapshot's 100,000 blocks may share one deep stack)."""
    by_site: dict[str, dict] = {}
    sites: dict[int, tuple[str, list[str]]] = {}
    for stack, nbytes in items:
        stack = int(stack)
        if stack not in sites:
            sites[stack] = site_of(rt.memory_stack(stack))
        site, frames = sites[stack]
        g = by_site.setdefault(site, {"site": site, "bytes": 0, "blocks": 0, "stack": frames})
        g["bytes"] += int(nbytes)
        g["blocks"] += 1
    return sorted(by_site.values(), key=lambda g: -g["bytes"])[:top]


def live_sites(rt: RankTrace, snapshot: int, top: int = 10) -> list[dict]:
    """The allocation sites holding the most memory when the snapshot was taken: active blocks
    grouped by site, largest first (site, bytes, blocks, stack)."""
    b = rt.memory_snapshot_rows(snapshot)["blocks"]
    b = b[b["state"] == "active_allocated"]
    return _group(rt, list(zip(b["stack"], b["size"])), top)


def history_peak(rt: RankTrace, snapshot: int, top: int = 10) -> dict | None:
    """The moment of most memory in the allocator's history held by a snapshot, and the sites
    live then: the snapshot's live blocks, walked back through the recorded allocations and frees.
    None without a history."""
    t = rt.memory_snapshot_rows(snapshot)
    trace = t["trace"]
    if not len(trace):
        return None
    blocks = t["blocks"]
    live: dict[int, tuple[int, int]] = {}  # addr -> (bytes, stack)
    for b in blocks[blocks["state"] == "active_allocated"].itertuples(index=False):
        live[int(b.address)] = (int(b.size), int(b.stack))
    actions = trace["action"].to_numpy()
    free_action = "free_completed" if (actions == "free_completed").any() else "free_requested"
    total = sum(v[0] for v in live.values())
    # Walk back: before an alloc its block was not live; before a free it was.
    totals = np.empty(len(trace) + 1, dtype=np.int64)
    totals[len(trace)] = total
    addr, size = trace["addr"].to_numpy(), trace["size"].to_numpy()
    for i in range(len(trace) - 1, -1, -1):
        if actions[i] == "alloc":
            total -= int(size[i])
        elif actions[i] == free_action:
            total += int(size[i])
        totals[i] = total
    k = int(np.argmax(totals))  # state just before entry k (k == len: at the snapshot)
    # Live blocks at k: those of the snapshot, undoing the entries from k on.
    for i in range(len(trace) - 1, k - 1, -1):
        a = int(addr[i])
        if actions[i] == "alloc":
            live.pop(a, None)
        elif actions[i] == free_action:
            live[a] = (int(size[i]), -1)
    # Stacks of blocks allocated within the history: their alloc entry before k.
    stacks = trace["stack"].to_numpy()
    last_alloc = {}
    for i in range(k):
        if actions[i] == "alloc":
            last_alloc[int(addr[i])] = int(stacks[i])
    items = [(st if st >= 0 else last_alloc.get(a, -1), n) for a, (n, st) in live.items()]
    times = trace["time_us"].to_numpy()
    when = int(times[k - 1]) if k > 0 else (int(times[0]) if len(times) else -1)
    return {"bytes": int(totals[k]), "entry": k, "time_us": when, "sites": _group(rt, items, top)}


def oom_request(rt: RankTrace, snapshot: int) -> dict | None:
    """The allocation that failed, from the history's last ``oom`` entry: its size, the free
    device memory the allocator saw, and its stack (what asked for more)."""
    trace = rt.memory_snapshot_rows(snapshot)["trace"]
    oom = trace[trace["action"] == "oom"]
    if not len(oom):
        return None
    e = oom.iloc[-1]
    site, frames = site_of(rt.memory_stack(int(e["stack"])))
    return {"bytes": int(e["size"]), "device_free": int(e["device_free"]), "site": site, "stack": frames}


def site_growth(rt: RankTrace, first: int, last: int, top: int = 3) -> list[dict]:
    """Allocation sites whose live bytes grew most from one snapshot to another."""
    a = {g["site"]: g for g in live_sites(rt, first, top=10**6)}
    b = {g["site"]: g for g in live_sites(rt, last, top=10**6)}
    grew = []
    for site, g in b.items():
        before = a.get(site, {"bytes": 0, "blocks": 0})
        d = g["bytes"] - before["bytes"]
        if d > 0:
            grew.append({"site": site, "bytes_before": before["bytes"], "bytes_after": g["bytes"],
                         "blocks_before": before["blocks"], "blocks_after": g["blocks"], "stack": g["stack"]})
    return sorted(grew, key=lambda g: -(g["bytes_after"] - g["bytes_before"]))[:top]
