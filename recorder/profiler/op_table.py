"""A profiler window's events turned into its table of operators, on the writer thread: one sweep
instead of torch.profiler's key_averages(), with the recorder's own work folded into one row.
"""

from __future__ import annotations

import json

import torch

from ..trace_file.schema import OWN_WORK_RANGE

_CPU = ("cpu_op", "user_annotation")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def window_events(prof, trace_json: bytes) -> list[tuple]:
    """A window's events as tuples: ("cpu", name, thread, start_us, dur_us, link), ("dev", name,
    dur_us, link) for a kernel or copy, ("mem", thread, time_us, bytes, on_device); `link` ties a
    device event to the CPU operator that launched it.

    From the profiler's own kineto events (~30 ms for the small transformer's 11k events); if
    this torch lacks them, from the exported Chrome trace (json.loads alone: ~230 ms)."""
    try:
        out = []
        for e in prof.profiler.kineto_results.events():
            name = e.name()
            on_cpu = e.device_type() == torch.autograd.DeviceType.CPU
            if name == "[memory]":
                out.append(("mem", e.start_thread_id(), e.start_ns() / 1e3, int(e.nbytes()), not on_cpu))
            elif on_cpu:
                if not e.is_python_function():
                    out.append(("cpu", name, e.start_thread_id(), e.start_ns() / 1e3, e.duration_ns() / 1e3,
                                e.correlation_id()))
            else:
                out.append(("dev", name, e.duration_ns() / 1e3, e.linked_correlation_id()))
        return out
    except Exception:  # (a private API: fall back on the documented export)
        pass
    out = []
    for e in json.loads(trace_json).get("traceEvents", []):
        cat, ph, args = e.get("cat"), e.get("ph"), e.get("args") or {}
        if ph == "X" and cat in _CPU:
            out.append(("cpu", str(e.get("name", "?")), e.get("tid"), float(e.get("ts", 0.0)),
                        float(e.get("dur", 0.0)), args.get("External id")))
        elif ph == "X" and cat in _DEVICE:
            out.append(("dev", str(e.get("name", "?")), float(e.get("dur", 0.0)), args.get("External id")))
        elif ph == "i" and e.get("name") == "[memory]":
            out.append(("mem", e.get("tid"), float(e.get("ts", 0.0)), int(args.get("Bytes", 0)),
                        bool(args.get("Device Type", 0))))
    return out


def op_table(events: list[tuple]) -> list[dict]:
    """Operators of a profiler window (window_events): calls, CPU time (self: without the
    operators called inside; total), device time, memory allocated (self).

    What torch.profiler's key_averages() gives (the same numbers on the small transformer), in
    one sweep: key_averages() took 0.6-0.7 s per window there (measured). CPU operators nest
    by time on their thread; a memory event counts for the innermost operator running then; a
    kernel or copy on the device is its own row (its device time is its self time) and adds its
    time to the operator that launched it. Operators inside the recorder's own range (own_work())
    are folded into its row: their time, memory and kernels are the recorder's, not the job's."""
    rows: dict[str, list] = {}

    def row(name: str) -> list:
        r = rows.get(name[:512])
        if r is None:
            r = rows[name[:512]] = [0, 0.0, 0.0, 0.0, 0.0, 0, 0]  # calls, cpu self/total, dev self/total, mem
        return r

    cpu, devs, items = [], [], []
    for e in events:
        if e[0] == "cpu":
            items.append((str(e[2]), e[3], 0, -e[4], len(cpu)))
            cpu.append(e)
        elif e[0] == "dev":
            devs.append(e)
        else:
            items.append((str(e[1]), e[2], 1, 0.0, e))
    # One sweep per thread over operators (outer before inner at equal start) and memory events.
    items.sort(key=lambda t: t[:4])
    child = [0.0] * len(cpu)
    owner = list(range(len(cpu)))  # the row each operator counts for: itself, or the recorder's range
    stack: list[tuple[float, int]] = []  # (end, operator) of the operators open on this thread
    tid = None
    for t, ts, kind, neg_dur, k in items:
        if t != tid:
            tid, stack = t, []
        while stack and stack[-1][0] <= ts:
            stack.pop()
        if kind == 0:
            if stack:
                parent = stack[-1][1]
                if owner[parent] != parent or cpu[parent][1] == OWN_WORK_RANGE:
                    owner[k] = owner[parent]  # inside the recorder's range: its self time
                else:
                    child[parent] += -neg_dur
            stack.append((ts - neg_dur, k))
        elif stack:
            r = row(cpu[owner[stack[-1][1]]][1])
            r[6 if k[4] else 5] += k[3]
    # Kernels the recorder's operators launched: device time of its row.
    folded = {cpu[k][5] for k, o in enumerate(owner) if o != k and cpu[k][5]}
    launched: dict = {}
    for _, name, dur, link in devs:
        ours = bool(link) and link in folded
        r = row(OWN_WORK_RANGE if ours else name)
        r[0] += 0 if ours else 1
        r[3] += dur
        r[4] += dur
        if link is not None and not ours:
            launched[link] = launched.get(link, 0.0) + dur
    for k, e in enumerate(cpu):
        if owner[k] != k:
            continue
        r = row(e[1])
        r[0] += 1
        r[1] += max(0.0, e[4] - child[k])
        r[2] += e[4]
        r[4] += launched.get(e[5], 0.0) if e[5] is not None else 0.0
    return [{"name": name, "calls": r[0], "cpu_self_us": r[1], "cpu_total_us": r[2], "device_self_us": r[3],
             "device_total_us": r[4], "cpu_memory_bytes": r[5], "device_memory_bytes": r[6]}
            for name, r in rows.items()]
