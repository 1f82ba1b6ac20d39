"""hang: the ranks' last minute, side by side: when each finished its steps, then what its
heartbeats found it doing (its phase) until its trace ends."""

from __future__ import annotations

import numpy as np

from ...analyzer.cross_rank import hang
from ...analyzer.cross_rank.digest import ends_of
from ...analyzer.findings import Finding
from ...analyzer.trace.phases import STOPPED_IN
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from .. import ranks
from ._text import step, text

KIND = "hang"
MAX_RANKS = 40  # rows drawn: the named rank first, then those that stopped elsewhere, then the others in order
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
    order = _drawn(ctx, f, ds)
    ends = [d.end_time for d in ds.values()]
    if not order or not np.isfinite(ends).any():
        return no_figure(title, "No rank recorded the times of its steps.")
    caption = (f"One row per rank{' (' + str(MAX_RANKS) + ' of them: the odd ones first)' if len(ds) > MAX_RANKS else ''}"
               f", over the time before the traces end (seconds, 0: the last heartbeat of any rank): ticks, the ends "
               f"of its steps; bars, what its heartbeats found it doing once steps stopped coming (colour: the phase). "
               f"The rank named by the finding is on top; {step(f.step)} is the step they were in.")
    return figure(title, caption, _plot, {r: _ends(ctx, r) for r in order}, float(np.nanmax(ends)),
                  height_in=float(np.clip(1.0 + 0.22 * len(order), 1.8, 7.0)))


def _drawn(ctx: Context, f: Finding, ds: dict) -> list[int]:
    """The ranks drawn: the named rank, then those that stopped elsewhere than most ranks (the
    counters' odd ranks), then the others in order, MAX_RANKS at most."""
    counts = ranks.counts(ctx)
    odd = []
    if counts is not None:
        t = counts.positions.tally
        top = t.most()
        odd = sorted(int(r) for k in t.count if k != top for r in t.ranks_of(k))
    first = list(dict.fromkeys(r for r in ([f.rank] if f.rank in ds else []) + odd if r in ds))
    seen = set(first)
    return (first + [r for r in sorted(ds) if r not in seen])[:MAX_RANKS]


def _ends(ctx: Context, r: int) -> dict:
    """A drawn rank's last step times and heartbeats, read from its file now (the Lights keep
    neither); none where it cannot be read (the findings say why)."""
    try:
        return ends_of(ctx.trace.ranks[r])
    except Exception:
        return {"time_unix": np.zeros(0), "heartbeats": [], "last_step": None}


def _plot(ds: dict, end: float, ax) -> None:
    # From a little before the first rank's last step (at least 5 s, at most 10 minutes).
    lasts = [float(d["time_unix"][-1]) for d in ds.values() if len(d["time_unix"]) and np.isfinite(d["time_unix"][-1])]
    window = float(np.clip(1.25 * (end - min(lasts)), 5.0, 600.0)) if lasts else 60.0
    seen = set()
    for row, (r, d) in enumerate(ds.items()):
        times = d["time_unix"]
        t = times[np.isfinite(times)] - end
        t = t[t >= -window]
        ax.plot(t, np.full(len(t), row), "|", color="#424242", ms=6)
        last = float(times[-1] - end) if len(times) else -window
        beats = [b for b in d["heartbeats"] if d["last_step"] is None or b["step"] > d["last_step"]]
        prev = max(last, -window)
        bars = []  # [left, right, phase]: a phase's heartbeats in a row one bar (matplotlib's time is per bar)
        for b in beats:
            x = b["time_unix"] - end
            if x <= prev:
                continue
            if bars and bars[-1][2] == b["phase"] and bars[-1][1] == prev:
                bars[-1][1] = x
            else:
                bars.append([prev, x, b["phase"]])
            prev = x
        for left, right, phase in bars:
            label = phase if phase not in seen else None
            seen.add(phase)
            ax.barh(row, right - left, left=left, height=0.6, color=PHASE_COLORS.get(phase, "#9e9e9e"), label=label)
    ax.set_yticks(range(len(ds)))
    ax.set_yticklabels([f"rank {r}" for r in ds], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(-window, 1)
    ax.set_xlabel("seconds before the end of the traces")
    ax.grid(axis="y", visible=False)
    if seen:
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), frameon=False, ncol=5, fontsize=7)
