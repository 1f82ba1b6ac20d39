"""hang (error): the job stopped making progress, and which rank stopped first, where.

Each rank's recorder writes a heartbeat while no step comes (recorder/distributed/heartbeat.py): the step in
progress, its phase, and once the step is long overdue the training thread's Python stack. A rank
is stalled when its last heartbeat finds the step in progress running for `min_stall_factor`
times its typical step and at least `min_stall_s`. The rank that stopped first is the one behind
the others: an earlier step, or an earlier phase of the same step (one rank still in its data
loading or forward while the others are in backward: they wait for it in the gradient
all-reduce). A rank whose trace ended (crashed, killed) while the others were still beating is
behind them too. Where every stalled rank stands at the same place, no rank is named: a hang in
the collective itself (the network, NCCL), which the NCCL flight recorder's dumps tell apart."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..trace.phases import PHASES
from . import counters
from .light import Light
from .merge import rank_set


@dataclass(frozen=True)
class HangConfig:
    # A step running this many times the rank's typical step, and this long, has stalled (the
    # recorder samples the stack at 10x, its stall_factor; a job's slowest healthy steps, such as
    # a checkpoint save or the first compiled step, stay under that in this project's samples).
    min_stall_factor: float = 10.0
    min_stall_s: float = 1.0


class Evidence(FindingEvidence, total=False):
    phase: str  # where in the step it stopped: between_steps | data | forward | backward | recorder
    last_step: int  # the last step it finished (-1: none)
    stalled_s: float  # how long the step in progress had run at its last heartbeat (s)
    at: str  # file:line of the innermost frame of the job's own code in its stack ("" if not sampled)
    code: str  # that line of code
    stack: list  # "file:line in function" of its innermost frames, innermost last
    others: list  # the other ranks by where they stood: {"ranks", "phase", "step", "at", "code"}
    nccl_flight_recorder: str  # where the job's NCCL flight-recorder dumps went ("" if not set)


KIND = "hang"
CONFIG = HangConfig
ORDER = 5
_LIBRARY = re.compile(r"([/\\](site|dist)-packages[/\\])|([/\\]lib[/\\]python\d)|(^<frozen )|([/\\]torchautopsy[/\\])")


def detect(digests, cfg: HangConfig, trace=None, counts=None) -> list[Finding]:
    """``counts``: the ranks' merged counters (counters.py; made here from ``digests`` if not given)."""
    if counts is None:
        counts = counters.of(digests, cfg) if digests else None
    if counts is None or not counts.positions.stalled:
        return []
    pos = counts.positions
    t = pos.tally
    # Ranks recorded without a heartbeat (turned off, an older recorder) cannot say where they
    # stood: the tally counts the others. Its places sort by the rank's position (step in
    # progress, phase) -- a rank whose trace ended without a stall (no heartbeat: it crashed or
    # was killed while steps came) stands at its next step's start.
    ranks = t.members.tolist()
    first = min(k[:2] for k in t.count)
    behind_at = sorted((k for k in t.count if k[:2] == first), key=lambda k: t.first[k])
    behind = sorted(int(r) for k in behind_at for r in t.ranks_of(k))
    # One rank alone, or some ranks behind the others: named. All at one place: none is.
    named = len(ranks) == 1 or len(behind) < len(ranks)
    culprit = behind[0]
    rep = pos.rep[behind_at[0]]  # (the culprit's: the smallest rank of its place)
    s = rep["state"] or {"step": first[0], "phase": "", "stalled": False, "at": "", "code": "", "stack": [],
                         "stalled_s": float("nan")}
    last_step = rep["last_step"] if rep["last_step"] is not None else -1
    others = _others(t, [k for k in t.count if k[:2] != first])
    nccl = _nccl(pos.nccl, trace)
    summary = _head(s, rep, behind, ranks, named, rep["state"] is None) + _tail(others, ranks, behind) + "."
    if nccl:
        summary += f" The job also wrote NCCL flight-recorder dumps ({nccl})."
    return [Finding(
        KIND, "error", int(s["step"]), [], summary,
        {"phase": s["phase"], "last_step": last_step,
         "stalled_s": s["stalled_s"], "at": s["at"], "code": s["code"], "stack": s["stack"], "others": others,
         **({"nccl_flight_recorder": nccl} if nccl else {})},
        _advice(s, named, len(ranks), nccl), rank=culprit if named else None)]


def place(state: dict | None, last_step: int | None) -> tuple:
    """Where a rank stood (the key counters.py counts ranks by): its position (step in progress,
    phase's order) then what the finding groups the other ranks by (step, phase, line, code)."""
    if state is None:  # (its trace ended while steps came: at its next step's start)
        step = (last_step if last_step is not None else -1) + 1
        return (step, -1, step, "", "", "")
    order = PHASES.index(state["phase"]) if state["phase"] in PHASES else 0
    return (state["step"], order, state["step"], state["phase"], state["at"], state["code"])


def _head(s: dict, rep: dict, behind: list[int], ranks: list[int], named: bool, ended: bool) -> str:
    """Who stopped, where (the step, its phase, the line of the stack) and for how long."""
    where = f"in step {s['step']:,}'s {_phase(s['phase'])}" if s["phase"] else f"before step {s['step']:,}"
    at = f", at {s['at']} (`{s['code']}`)" if s["at"] and s["code"] else (f", at {s['at']}" if s["at"] else "")
    if named and ended:
        last = rep["last_step"] if rep["last_step"] is not None else -1
        return (f"Rank {behind[0]}'s trace ends after step {last:,} "
                f"({rep['end_reason'] or 'killed: not closed'}) while the other ranks were still running")
    if named:
        whose = "its" if len(behind) == 1 else "their"
        return (f"{rank_set(behind, ranks).capitalize()} stopped {where}{at} and made no progress for "
                f"{s['stalled_s']:,.0f} s until {whose} trace ends")
    return f"All {len(ranks):,} ranks stopped {where}{at}, none behind the others: for {s['stalled_s']:,.0f} s"


def _tail(others: list[dict], ranks: list[int], behind: list[int]) -> str:
    """Where the other ranks waited (the three largest groups), and for whom."""
    if not others:
        return ""
    text = "".join(f"; {_others_phrase(o['ranks'], ranks, len(others) == 1)} waited in step {o['step']:,}'s "
                   f"{_phase(o['phase'])}" + (f", at {o['at']} (`{o['code']}`)" if o["at"] else "")
                   for o in others[:3])
    return text + ": in a collective, waiting for " + ("it" if len(behind) == 1 else "them")


def where_stopped(d, cfg: HangConfig) -> dict | None:
    """Where a rank stood at its last heartbeat, or None if it wrote none after its last step. ``d``:
    a digest, or a Light (which keeps that heartbeat alone, without its stack)."""
    b = d.beat if isinstance(d, Light) else last_beat(d)
    if b is None:
        return None
    typical = b["typical_step_s"] if b["typical_step_s"] == b["typical_step_s"] else 0.0
    stalled = b["step_s"] >= max(cfg.min_stall_s, cfg.min_stall_factor * typical)
    return {"step": int(b["step"]), "phase": b["phase"], "stalled": stalled, "stalled_s": float(b["step_s"]),
            "at": b["at"], "code": b["code"], "stack": b.get("stack", [])}


def last_beat(d) -> dict | None:
    """A digest's last heartbeat after its last step, with the line of the job's own code its
    stack was in then ("at", "code") and the stack's innermost frames; None if it wrote none
    after its last step, or if its recorder stopped on its own error (the training went on, unrecorded)."""
    beats = [b for b in d.heartbeats if d.last_step is None or b["step"] > d.last_step]
    if not beats or d.end_reason.startswith("recorder error"):
        return None
    b = beats[-1]
    frames = d.last_stack if d.last_stack_step == b["step"] else None
    at, code, stack = "", "", []
    if frames:
        own = [f for f in frames if not _LIBRARY.search(f[0])] or list(frames)
        f = own[-1]
        at, code = f"{os.path.basename(f[0])}:{f[1]}", f[3].strip()
        stack = [f"{fr[0]}:{fr[1]} in {fr[2]}" for fr in frames[-12:]]
    return {**b, "at": at, "code": code, "stack": stack}


def _others(t, places) -> list[dict]:
    """The other ranks grouped by where they stood (most ranks first; ties: the smaller rank first)."""
    groups: dict[tuple, list] = {}
    for k in places:
        groups.setdefault(k[2:], []).append(t.ranks_of(k))
    rows = [(sorted(int(r) for a in held for r in a), k) for k, held in groups.items()]
    return [{"ranks": rs, "step": k[0], "phase": k[1], "at": k[2], "code": k[3]}
            for rs, k in sorted(rows, key=lambda row: (-len(row[0]), row[0][0]))]


def _others_phrase(group: list[int], ranks: list[int], all_others: bool) -> str:
    """"the other 63 ranks", "rank 7", "ranks 8-15"."""
    if all_others and len(group) > 1:
        return f"the other {len(group):,} ranks"
    return rank_set(group, ranks)


def _phase(p: str) -> str:
    return {"between_steps": "start (before its forward)", "data": "data loading", "forward": "forward",
            "backward": "backward (or optimizer step)", "recorder": "rec.step()"}.get(p, "start")


def _nccl(first_env: tuple | None, trace) -> str:
    """Where NCCL's flight recorder dumped (its TORCH_NCCL_DEBUG_INFO_TEMP_FILE prefix, and the dump
    files found beside the traces), if the job turned it on. ``first_env``: (rank, its NCCL
    environment) of the smallest rank that recorded one."""
    env = first_env[1] if first_env else {}
    if not (env.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or env.get("TORCH_FR_BUFFER_SIZE")):
        return ""
    prefix = env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
    found = []
    if trace is not None and os.path.isdir(trace.run_dir):  # (names listed only: dumps are pickles, never opened)
        base = os.path.basename(prefix)
        found = sorted(n for n in os.listdir(trace.run_dir) if base and n.startswith(base))[:8]
    return f"{prefix}<rank>" + (f"; in the run directory: {', '.join(found)}" if found else "")


def _advice(s, named, n_ranks, nccl) -> str:
    read = (" Read the NCCL flight-recorder dumps with `python -m torch.distributed.flight_recorder.fr_trace` "
            "(PyTorch's tool) to see which collective each rank was in.") if nccl else \
        " Next time set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 and TORCH_NCCL_DUMP_ON_TIMEOUT=1 so NCCL dumps its " \
        "collectives on a timeout."
    if n_ranks == 1:
        return ("The job stopped making progress at the line above: a deadlock, a DataLoader that hangs (a dead "
                "worker, a lock, a remote filesystem), a blocking call or a collective waiting for a process "
                "outside this trace." + (read if nccl else ""))
    if not named:
        return ("Every rank waited at the same place: a collective that never completed (a network or NCCL "
                "problem, a rank outside this trace, mismatched collectives)." + read)
    if s["phase"] in ("data", "between_steps"):
        return ("It stopped before its forward: a DataLoader that hangs (a dead worker, a lock, a remote "
                "filesystem), code that runs on that rank only, or a collective that only some ranks call "
                "(e.g. under `if rank == 0:`)." + read)
    return ("The other ranks waited for it in a collective. Look at the line above on that rank: a collective "
            "called by some ranks only or in a different order, a data-dependent branch, a deadlock, or a "
            "failing GPU on that node." + read)
