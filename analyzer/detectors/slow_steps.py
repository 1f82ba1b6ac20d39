"""slow_steps (info): steps slower than `ratio` x the median step, and what was different in them.

For each outlier: which phase grew against its median (waiting for data, other work between
steps, forward, backward and optimizer, the recorder), and what coincided with it — the first
step (lazy initialisation, warm-up), a profiler window, a tensor census, a CUDA allocator
snapshot, a jump in memory (resident, CUDA reserved: new cudaMalloc segments are slow, CUDA
allocated), or Python's garbage collector (time spent collecting, full collections).

Outliers the recorder made on purpose (profiler windows and the steps that ran while its writer
thread exported one, steps whose extra time is the recorder's own: a census, a snapshot) and the
first step are listed as expected; only the others make a finding. The median is taken over
steps outside profiler windows and their export, after the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..trace import RankTrace
from ..trace.phases import TIMED, TIMED_NAMES
from ..trace.step_time import phases


@dataclass(frozen=True)
class SlowStepsConfig:
    # A step slower than this many times the median step, and by at least `min_excess_s`, is an
    # outlier worth a look (below 50 ms, OS scheduling and garbage collection on a shared
    # machine make millisecond steps jitter by several times; measured on this project's CI).
    ratio: float = 3.0
    min_excess_s: float = 0.05
    min_steps: int = 20
    max_listed: int = 10


class Evidence(FindingEvidence, total=False):
    median_step_s: float  # median step time (s), over the steps outside profiler windows, after the first
    slow_steps: int  # how many slow steps are unexpected (those the finding is about)
    slowest: list  # the unexpected slow steps, slowest first (at most max_listed): one dict each (below)
    expected: list  # ... the slow steps the first step or the recorder explain, as dicts of the same keys
    expected_slow_steps: int  # how many slow steps are expected


# Each dict of ``slowest`` and ``expected``: step, step_s and excess_s (its time and its excess over
# the median, s), slowest_phase (the phase that grew most, in words), phase_s and phase_median_s (its
# time and median, s), phases_grown ({phase: {"s", "median_s"}} of the phases holding 20%+ of the
# excess), coincided_with (what else happened then, in words), expected (bool).


KIND = "slow_steps"
REQUIRES = ("steps/forward_s",)
CONFIG = SlowStepsConfig  # its thresholds: a [slow_steps] table of analyze --config
ORDER = 160  # among findings of one step and stage, the detectors run (and list) in this order

MIB = 2**20
# A memory change between two steps counts as a jump when it is at least this large and 10x the
# median change: on the five healthy sample traces RSS moves by 0 MiB at the median step, at most
# 10-46 MiB in one step (measured), so 64 MiB is more than a healthy allocator's step.
MEMORY_JUMP_BYTES = 64 * MIB
# The phases a slow step's time is split into (columns of _StepRecord.parts): the time between
# steps splits into the DataLoader's wait (when one was used) and the rest of the loop's work.
PART_NAMES = ["waiting for data", "other work between steps"] + [TIMED_NAMES[p] for p in TIMED[1:]]
_RECORDER = PART_NAMES.index(TIMED_NAMES["recorder_s"])
_JUMP_COLUMNS = (("rss_bytes", "resident memory"), ("cuda_reserved_bytes", "CUDA reserved memory"),
                 ("cuda_allocated_bytes", "CUDA allocated memory"))

ADVICE = ("Occasional slow steps in the data phase point at the input pipeline (a slow shard, "
          "worker restarts); in the forward/backward at shape changes (recompilation, cudnn "
          "benchmarking) or memory pressure (a jump in reserved memory: new cudaMalloc calls, "
          "or the allocator freeing its cache and retrying); steps with a full garbage collection "
          "at many live Python objects (gc.freeze() after start-up, fewer objects per step); "
          "in the recorder at its sparse probes (census, snapshots, profiler windows).")


def _jumps(values: np.ndarray) -> np.ndarray:
    """Per step, the change from the previous step where it is a jump, else 0."""
    v = values.astype(float)
    d = np.zeros_like(v)
    if len(v) < 2:
        return d
    d[1:] = np.diff(v)
    d[1:][(v[1:] < 0) | (v[:-1] < 0)] = 0.0  # not measured (-1)
    typical = float(np.median(np.abs(d[1:]))) if len(d) > 1 else 0.0
    return np.where(np.abs(d) >= max(MEMORY_JUMP_BYTES, 10 * typical), d, 0.0)


def _profiled(rt: RankTrace) -> np.ndarray:
    """Per step, whether it ran in a torch.profiler window or while the recorder exported one."""
    steps = rt.step_index
    in_window = np.zeros(len(steps), dtype=bool)
    pw = rt.profile_windows
    ends = rt.columns["time_s"].to_numpy(dtype=float)  # when each step's rec.step() ran
    starts = np.concatenate([[-np.inf], ends[:-1]])
    exported = pw["exported_unix"].to_numpy(dtype=float) if "exported_unix" in pw else np.full(len(pw), np.nan)
    if len(steps) > 1 and not (np.diff(steps) > 0).all():  # (not one timeline: judged step by step)
        for a, b, done in zip(pw.get("step_start", []), pw.get("step_end", []), exported):
            in_window |= (steps >= a) & (steps <= b)
            in_window |= (steps > b) & ((starts < done) if np.isfinite(done) else (steps == b + 1))
        return in_window
    # Rows found by bisection: a window every 1,000 steps of a 1M-step run is 1,000 windows.
    for a, b, done in zip(pw.get("step_start", []), pw.get("step_end", []), exported):
        lo, hi = np.searchsorted(steps, a, "left"), np.searchsorted(steps, b, "right")
        in_window[lo:hi] = True
        # The recorder's writer thread then exports the window (under the GIL): the steps that
        # ran until it was done, or the next one in traces that do not say when that was.
        if np.isfinite(done):
            later = starts[hi:] < done
            in_window[hi:hi + (int(np.argmin(later)) if not later.all() else len(later))] = True
        elif hi < len(steps) and steps[hi] == b + 1:
            in_window[hi] = True
    return in_window


@dataclass(frozen=True)
class _StepRecord:
    """Per step, what the trace says about its time and about what else happened in it."""

    steps: np.ndarray
    total: np.ndarray  # the step's time (s)
    parts: np.ndarray  # steps x PART_NAMES (s)
    median_parts: np.ndarray  # each part's median over the baseline steps (s)
    in_window: np.ndarray  # in a profiler window or its export
    census: np.ndarray  # a tensor census ran
    snapshot_steps: set  # steps with a CUDA allocator snapshot
    blackbox_steps: set  # the step the black box kept (it copied the model's state inside the step)
    gc_s: np.ndarray
    gc_gen2: np.ndarray  # full collections
    jumps: dict  # {memory label: per-step jump in bytes, 0 where none}


def _read_steps(rt: RankTrace, t: np.ndarray, total: np.ndarray, base: np.ndarray,
                in_window: np.ndarray) -> _StepRecord:
    df = rt.columns
    wait = np.nan_to_num(df["data_wait_s"].to_numpy(dtype=float), nan=0.0)
    parts = np.column_stack([wait, t[:, 0] - wait, t[:, 1:]])
    snaps = rt.memory_snapshots
    return _StepRecord(
        steps=rt.step_index, total=total, parts=parts, median_parts=np.nanmedian(parts[base], axis=0),
        in_window=in_window, census=df["live_tensors"].to_numpy() >= 0,
        snapshot_steps=set(int(s) for s in snaps["step"]) if len(snaps) else set(),
        blackbox_steps=set(int(s) for s in rt.blackbox["step"]),
        gc_s=df["gc_s"].to_numpy(dtype=float), gc_gen2=df["gc_gen2"].to_numpy(),
        jumps={label: _jumps(df[c].to_numpy()) for c, label in _JUMP_COLUMNS})


def _measure(r: _StepRecord, i: int, median: float) -> dict:
    """One slow step: its time, the phase that grew most, what coincided, whether expected."""
    excess = float(r.total[i] - median)
    grew = r.parts[i] - r.median_parts
    k = int(np.nanargmax(grew))
    return {"step": int(r.steps[i]), "step_s": float(r.total[i]), "excess_s": excess,
            "slowest_phase": PART_NAMES[k], "phase_s": float(r.parts[i, k]),
            "phase_median_s": float(r.median_parts[k]),
            "phases_grown": {PART_NAMES[j]: {"s": float(r.parts[i, j]), "median_s": float(r.median_parts[j])}
                             for j in np.argsort(-np.nan_to_num(grew, nan=-np.inf))
                             if np.isfinite(grew[j]) and grew[j] >= 0.2 * excess},
            "coincided_with": _coincided(r, i, excess),
            # Expected: the recorder's own probes (its time, a profiler window, the black box's
            # copies, made inside the step: at the optimizer step) or the first step.
            "expected": bool(i == 0 or r.in_window[i] or int(r.steps[i]) in r.blackbox_steps
                             or (np.isfinite(grew[_RECORDER]) and grew[_RECORDER] >= 0.5 * excess))}


def _coincided(r: _StepRecord, i: int, excess: float) -> list[str]:
    """What else happened in step row i, in words."""
    also = []
    if i == 0:
        also.append("the first step (lazy initialisation, warm-up)")
    if r.in_window[i]:
        also.append("a torch.profiler window")
    if r.census[i]:
        also.append("a tensor census")
    if int(r.steps[i]) in r.snapshot_steps:
        also.append("a CUDA allocator snapshot")
    if int(r.steps[i]) in r.blackbox_steps:
        also.append("the black box keeping the step's state")
    for label, j in r.jumps.items():
        if j[i]:
            also.append(f"{label} {'+' if j[i] > 0 else '-'}{abs(j[i]) / MIB:,.0f} MiB")
    gc_s, gen2 = r.gc_s[i], r.gc_gen2[i]
    # A collection that took a fifth of the excess, or any full one, may explain the step.
    if np.isfinite(gc_s) and (gc_s >= 0.2 * excess or gen2 > 0):
        also.append(f"garbage collection {gc_s * 1e3:,.0f} ms"
                    + (f" ({int(gen2)} full collection{'s' if gen2 != 1 else ''})" if gen2 > 0 else ""))
    return also


def detect(rt: RankTrace, cfg: SlowStepsConfig) -> list[Finding]:
    t, total = phases(rt)
    ok = np.isfinite(total) & (total > 0)
    in_window = _profiled(rt)
    # The median is of ordinary steps: not the recorder's profiler windows, not the first step,
    # which pays for lazy initialisation.
    base = ok & ~in_window
    if len(base):
        base[0] = False
    if base.sum() < cfg.min_steps:
        return []
    median = float(np.median(total[base]))
    slow = np.flatnonzero(ok & (total > cfg.ratio * median) & (total - median >= cfg.min_excess_s))
    if not slow.size:
        return []
    record = _read_steps(rt, t, total, base, in_window)
    measured = [_measure(record, int(i), median) for i in slow[np.argsort(-total[slow])]]
    listed = [d for d in measured if not d["expected"]]
    expected = [d for d in measured if d["expected"]]
    if not listed:
        return []
    evidence = {"median_step_s": median, "slow_steps": len(listed),
                "slowest": listed[: cfg.max_listed], "expected": expected[: cfg.max_listed],
                "expected_slow_steps": len(expected)}
    return [Finding(KIND, "info", listed[0]["step"], [], _summary(listed, len(expected), median, cfg),
                    evidence, ADVICE)]


def _summary(listed: list[dict], n_expected: int, median: float, cfg: SlowStepsConfig) -> str:
    top = listed[0]
    also = f", together with {', '.join(top['coincided_with'])}" if top["coincided_with"] else ""
    causes = sorted({d["slowest_phase"] for d in listed})
    summary = (f"{len(listed)} step(s) took over {cfg.ratio:g}x the median step ({median * 1e3:.1f} ms); the "
               f"slowest, step {top['step']}, took {top['step_s'] * 1e3:.1f} ms, mostly "
               f"{top['slowest_phase']} ({top['phase_s'] * 1e3:.1f} ms against a median of "
               f"{top['phase_median_s'] * 1e3:.1f} ms)"
               f"{also}. Slow phases: {', '.join(causes)}.")
    if n_expected:
        summary += (f" {n_expected} more slow step(s) are expected: the first step, profiler windows or "
                    f"the recorder's own probes.")
    return summary
