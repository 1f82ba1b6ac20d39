"""host_device_copies: copies between host and GPU take a large share of the step.

Data: the operator table of each torch.profiler window (profile_ops): the device time of the
CUDA copy operations ("Memcpy HtoD", "Memcpy DtoH"), against the wall time of the window's
steps (steps/ phases). Heuristic: in any window the copies take `share` of the steps' time or
more: a warning at the window's first step. Runs without CUDA activity are not judged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..trace import RankTrace
from ..trace.step_time import phases


@dataclass(frozen=True)
class HostDeviceCopiesConfig:
    # Share of the profiled steps' wall time spent in host<->device copies (CUDA "Memcpy HtoD" /
    # "Memcpy DtoH" device time). A fed GPU copies each batch once, a few percent of a step;
    # copies that take a fifth of the step point at tensors moved back and forth (.cpu(),
    # .item(), .numpy(), pageable memory) — HTA's memory-bandwidth analysis flags the same.
    share: float = 0.2


class Evidence(FindingEvidence, total=False):
    window: int  # the profiler window that showed it (the first that did)
    steps: list  # [first, last] step of that window
    copy_s: float  # device time of its host<->device copies (s)
    steps_wall_s: float  # wall time of its steps (s)
    share: float  # copy_s over steps_wall_s (0-1)
    threshold_share: float  # the share that counts (share of the config)
    copies: dict  # {copy operation ("Memcpy HtoD", "Memcpy DtoH"...): its device time (s)}


KIND = "host_device_copies"
REQUIRES = ("profile_ops/device_self_us",)
CONFIG = HostDeviceCopiesConfig  # its thresholds: a [host_device_copies] table of analyze --config
ORDER = 150  # among findings of one step and stage, the detectors run (and list) in this order

_COPY_NAMES = ("Memcpy HtoD", "Memcpy DtoH")
_ADVICE = (
    "Keep tensors on the GPU between steps: avoid .cpu(), .item(), .numpy() and printing of "
    "device tensors inside the loop (log every N steps, or accumulate on the device); move each "
    "batch once, with pin_memory=True in the DataLoader and .to(device, non_blocking=True); "
    "create constants on the device instead of copying them every step."
)


def detect(rt: RankTrace, cfg: HostDeviceCopiesConfig) -> list[Finding]:
    windows = rt.profile_windows
    if not len(windows):
        return []
    ops = rt.profile_ops()
    if not len(ops) or not (ops["device_self_us"] > 0).any():
        return []  # no CUDA activity was profiled
    t, total = phases(rt)
    steps = rt.step_index
    findings = []
    for w in windows.itertuples():
        in_window = (steps >= w.step_start) & (steps <= w.step_end)
        wall_s = float(np.nansum(total[in_window]))
        mine = ops[ops["window"] == w.window]
        copies = mine[mine["name"].str.startswith(_COPY_NAMES)]
        copy_s = float(copies["device_self_us"].sum()) / 1e6
        if wall_s <= 0 or copy_s / wall_s < cfg.share:
            continue
        by_kind = {str(r.name): float(r.device_self_us) / 1e6 for r in copies.itertuples()}
        summary = (f"Copies between host and GPU took {copy_s / wall_s:.0%} of steps {int(w.step_start)}-"
                   f"{int(w.step_end)} ({copy_s * 1e3:.1f} ms of {wall_s * 1e3:.1f} ms, profiler window "
                   f"{int(w.window)}): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in by_kind.items()) + ".")
        evidence = {"window": int(w.window), "steps": [int(w.step_start), int(w.step_end)],
                    "copy_s": copy_s, "steps_wall_s": wall_s, "share": copy_s / wall_s,
                    "threshold_share": cfg.share, "copies": by_kind}
        findings.append(Finding(KIND, "warning", int(w.step_start), [], summary, evidence, _ADVICE))
        break  # the first window that shows it; later windows repeat the same advice
    return findings
