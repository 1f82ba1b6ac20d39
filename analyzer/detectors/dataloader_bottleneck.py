"""dataloader_bottleneck: the training waits for its input.

Heuristic: the median share of a step (host clock) spent in DataLoader.__next__ waiting for the
next batch, after `skip_steps` (worker start-up), reaches `share`. Dated from the first step
after which the trailing median share stays above. Loops that feed batches without a DataLoader
are not judged (their wait cannot be told from other work between steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..series import trailing_median
from ..trace import RankTrace
from ..trace.phases import TIMED
from ..trace.step_time import phases


@dataclass(frozen=True)
class DataloaderBottleneckConfig:
    # Share of the step's wall time spent waiting for the next batch (median over the run after
    # `skip_steps`). A healthy input pipeline keeps the GPU/CPU fed with a few percent of wait;
    # PyTorch's performance tuning guide and HTA's idle-time analysis treat a data-bound step as
    # the first thing to fix. 30% (our measurement: the healthy sample traces wait under 5%).
    share: float = 0.3
    skip_steps: int = 5  # the first batches wait for worker start-up
    min_steps: int = 20


class Evidence(FindingEvidence, total=False):
    data_wait_share: float  # median share of a step spent waiting for the DataLoader's next batch (0-1)
    threshold_share: float  # the share that counts (share of the config)
    median_step_s: float  # median step time (s), over the steps timed
    median_data_wait_s: float  # median wait for the next batch (s)
    median_between_steps_s: float  # median time between steps, the wait included (s)
    median_forward_s: float  # median forward time (s)
    median_backward_s: float  # median backward and optimizer time (s)
    median_recorder_s: float  # median time the recorder took (s)
    steps_timed: int  # steps judged: timed, with a DataLoader, after skip_steps


KIND = "dataloader_bottleneck"
REQUIRES = ("steps/data_wait_s",)
CONFIG = DataloaderBottleneckConfig  # its thresholds: a [dataloader_bottleneck] table of analyze --config
ORDER = 140  # among findings of one step and stage, the detectors run (and list) in this order

_ADVICE_DATA = (
    "The model waits for its input: give the DataLoader more workers (num_workers, about the "
    "number of CPU cores), pin_memory=True and persistent_workers=True on GPU, a larger "
    "prefetch_factor; move expensive decoding/augmentation out of __getitem__ (pre-process once, "
    "cache, or do it on the GPU in batches); check the storage the data is read from."
)


def detect(rt: RankTrace, cfg: DataloaderBottleneckConfig) -> list[Finding]:
    t, total = phases(rt)
    wait = rt.columns["data_wait_s"].to_numpy(dtype=float)
    ok = np.isfinite(total) & (total > 0) & np.isfinite(wait)
    ok[: cfg.skip_steps] = False
    if ok.sum() < cfg.min_steps:
        return []  # no DataLoader was used (its batches are what is timed), or a short run
    share = np.where(ok, wait / np.where(ok, total, 1.0), np.nan)
    median_share = float(np.nanmedian(share))
    if median_share < cfg.share:
        return []
    above = trailing_median(share, 10) >= cfg.share
    below = np.flatnonzero(~above & ok)
    begin = int(below[-1] + 1) if below.size and below[-1] + 1 < len(share) else int(np.flatnonzero(ok)[0])
    med = {p: float(np.nanmedian(t[ok, k])) for k, p in enumerate(TIMED)}
    med_wait = float(np.nanmedian(wait[ok]))
    step = int(rt.step_index[begin])
    summary = (f"The input pipeline is the bottleneck: {median_share:.0%} of the median step "
               f"({float(np.nanmedian(total[ok])) * 1e3:.1f} ms) is spent waiting for the DataLoader's "
               f"next batch ({med_wait * 1e3:.1f} ms), against {med['forward_s'] * 1e3:.1f} ms forward and "
               f"{med['backward_s'] * 1e3:.1f} ms backward and optimizer.")
    evidence = {"data_wait_share": median_share, "threshold_share": cfg.share,
                "median_step_s": float(np.nanmedian(total[ok])), "median_data_wait_s": med_wait,
                **{f"median_{p}": v for p, v in med.items()}, "steps_timed": int(ok.sum())}
    return [Finding(KIND, "warning", step, [], summary, evidence, _ADVICE_DATA)]
