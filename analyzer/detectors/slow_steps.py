"""slow_steps (info): steps slower than `ratio` x the median step, each with the phase that made
it slow (waiting for data, forward, or backward and optimizer). Steps the recorder slowed on
purpose (profiler windows, a tensor census) are left out."""

from __future__ import annotations

import numpy as np

from ..config import SlowStepsConfig
from ..findings import Finding
from ..trace import RankTrace
from ._step_time import PHASE_NAMES, PHASES, phases

KIND = "slow_steps"
REQUIRES = ("steps/forward_s",)


def detect(rt: RankTrace, cfg: SlowStepsConfig) -> list[Finding]:
    t, total = phases(rt)
    ok = np.isfinite(total) & (total > 0)
    ok[0] = False  # the first step pays for lazy initialisation
    # Steps the recorder itself slowed on purpose are not outliers of the training: profiler
    # windows, and steps whose extra time is the recorder's own (a census).
    steps = rt.step_index
    for a, b in zip(rt.profile_windows.get("step_start", []), rt.profile_windows.get("step_end", [])):
        ok &= ~((steps >= a) & (steps <= b))
    ok &= ~(t[:, 3] > 0.5 * total)
    if ok.sum() < cfg.min_steps:
        return []
    median = float(np.median(total[ok]))
    slow = np.flatnonzero(ok & (total > cfg.ratio * median) & (total - median >= cfg.min_excess_s))
    if not slow.size:
        return []
    # The time between steps splits into the DataLoader's part (when one was used) and the rest.
    wait = np.nan_to_num(rt.steps["data_wait_s"].to_numpy(dtype=float), nan=0.0)
    parts = np.column_stack([wait, t[:, 0] - wait, t[:, 1:]])
    names = ["waiting for data", "other work between steps"] + [PHASE_NAMES[p] for p in PHASES[1:]]
    med_parts = np.nanmedian(parts[ok], axis=0)
    listed = []
    for i in slow[np.argsort(-total[slow])][: cfg.max_listed]:
        k = int(np.nanargmax(parts[i] - med_parts))
        listed.append({"step": int(rt.step_index[i]), "step_s": float(total[i]),
                       "slowest_phase": names[k], "phase_s": float(parts[i, k])})
    causes = sorted({d["slowest_phase"] for d in listed})
    summary = (f"{len(slow)} step(s) took over {cfg.ratio:g}x the median step ({median * 1e3:.1f} ms); the "
               f"slowest, step {listed[0]['step']}, took {listed[0]['step_s'] * 1e3:.1f} ms, mostly "
               f"{listed[0]['slowest_phase']}. Slow phases: {', '.join(causes)}.")
    advice = ("Occasional slow steps in the data phase point at the input pipeline (a slow shard, "
              "worker restarts, garbage collection); in the forward/backward at shape changes "
              "(recompilation, cudnn benchmarking) or memory pressure; in the recorder at its "
              "sparse probes (census, profiler windows).")
    return [Finding(KIND, "info", listed[0]["step"], [], summary,
                    {"median_step_s": median, "slow_steps": len(slow), "slowest": listed}, advice)]
