"""hang: the ranks' last minute, side by side: when each finished its steps, then what its
heartbeats found it doing (its phase) until its trace ends."""

from __future__ import annotations

import numpy as np

from ...analyzer.cross_rank import hang
from ...analyzer.findings import Finding
from ...analyzer.trace.phases import STOPPED_IN
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from .. import ranks
from ._text import step, text

KIND = "hang"
MAX_RANKS = 40  # rows drawn: the named rank first, then the others in order
PHASE_COLORS = {"data": "#ef6c00", "between_steps": "#ffb74d", "forward": "#c62828", "backward": "#1565c0",
                "recorder": "#757575", "": "#9e9e9e"}




def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: hang.Evidence = f.evidence
    # (the verdict adds "on rank N" to a finding's phrase: not named here)
    who = "the job stopped" if f.rank is not None else "every rank stopped"
    phase = STOPPED_IN.get(ev.get("phase") or "", "start")
    return text(f"{who} in {step(f.step)}'s {phase}"
                + (f" at {ev.get('at')}" if ev.get("at") else ""))


def figure_for(ctx: Context, f: Finding) -> Figure | None:
    title = "Where each rank stopped"
    ds = ranks.digests(ctx)
    order = ([f.rank] if f.rank in ds else []) + [r for r in sorted(ds) if r != f.rank]
    order = order[:MAX_RANKS]
    ends = [d.heartbeats[-1]["time_unix"] if d.heartbeats else (d.time_unix[-1] if len(d.time_unix) else np.nan)
            for d in ds.values()]
    if not order or not np.isfinite(ends).any():
        return no_figure(title, "No rank recorded the times of its steps.")
    caption = (f"One row per rank{' (the first ' + str(MAX_RANKS) + ')' if len(ds) > MAX_RANKS else ''}, over the "
               f"time before the traces end (seconds, 0: the last heartbeat of any rank): ticks, the ends of "
               f"its steps; bars, what its heartbeats found it doing once steps stopped coming (colour: the phase). "
               f"The rank named by the finding is on top; {step(f.step)} is the step they were in.")
    return figure(title, caption, _plot, {r: ds[r] for r in order}, float(np.nanmax(ends)),
                  height_in=float(np.clip(1.0 + 0.22 * len(order), 1.8, 7.0)))


def _plot(ds: dict, end: float, ax) -> None:
    # From a little before the first rank's last step (at least 5 s, at most 10 minutes).
    lasts = [float(d.time_unix[-1]) for d in ds.values() if len(d.time_unix) and np.isfinite(d.time_unix[-1])]
    window = float(np.clip(1.25 * (end - min(lasts)), 5.0, 600.0)) if lasts else 60.0
    seen = set()
    for row, (r, d) in enumerate(ds.items()):
        t = d.time_unix[np.isfinite(d.time_unix)] - end
        t = t[t >= -window]
        ax.plot(t, np.full(len(t), row), "|", color="#424242", ms=6)
        last = float(d.time_unix[-1] - end) if len(d.time_unix) else -window
        beats = [b for b in d.heartbeats if d.last_step is None or b["step"] > d.last_step]
        prev = max(last, -window)
        for b in beats:
            x = b["time_unix"] - end
            if x <= prev:
                continue
            label = b["phase"] if b["phase"] not in seen else None
            seen.add(b["phase"])
            ax.barh(row, x - prev, left=prev, height=0.6, color=PHASE_COLORS.get(b["phase"], "#9e9e9e"), label=label)
            prev = x
    ax.set_yticks(range(len(ds)))
    ax.set_yticklabels([f"rank {r}" for r in ds], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(-window, 1)
    ax.set_xlabel("seconds before the end of the traces")
    ax.grid(axis="y", visible=False)
    if seen:
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, ncol=5, fontsize=7)
