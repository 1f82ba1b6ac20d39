"""What each rank contributes to the cross-rank analysis: a few per-step series and its end,
computed where the rank is read (a worker process, analyzer/parallel.py, or a Dask task,
analyzer/cluster.py): ~0.4 MB a rank at 10,000 steps. The parent keeps only its Light (light.py:
the series in buckets and the exact values the detectors ask of it) and the ranks' merged
counters (counters.py); the rank's own tables are never sent."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..errors import TraceError
from ..trace.rank import RankTrace
from .buckets import Buckets, width_for

# The step's phases as the recorder splits a step's wall time (steps/*_s), in the order they run.
# "data" is inside "between_steps" in the file (the wait in DataLoader.__next__); here it is apart.
PHASE_COLUMNS = {"data": "data_wait_s", "between_steps": "between_steps_s", "forward": "forward_s",
                 "backward": "backward_s", "recorder": "recorder_s"}
MAX_HEARTBEATS = 50  # the last rows of a rank's heartbeats kept
TAIL = 1024  # the last step times of a rank the hang figure draws (its ticks)


@dataclass
class RankDigest:
    rank: int
    file: str
    steps: np.ndarray  # step numbers (int64)
    time_unix: np.ndarray  # when each step's rec.step() ran
    loss: np.ndarray
    phases: dict[str, np.ndarray]  # PHASE_COLUMNS' keys -> seconds (NaN: not seen); data apart from between
    grad_norm: np.ndarray  # total gradient L2 norm
    local_grad: np.ndarray  # this rank's own gradient norm before DDP's all-reduce (NaN: not measured)
    memory: np.ndarray  # bytes: CUDA peak of the step if measured, else resident memory
    memory_kind: str  # "cuda_peak" | "rss"
    replicated: bool  # every parameter whole on this rank (DDP), so fingerprints compare
    param_names: list[str]
    fp_steps: np.ndarray  # steps with fingerprints
    fp_hash: np.ndarray  # one hash (int64) of each fingerprint row
    closed_cleanly: bool
    end_reason: str
    heartbeats: list[dict] = field(default_factory=list)  # the last ones: step, phase, time_unix, ...
    last_stack: list | None = None  # the last stack a heartbeat sampled (frames, innermost last)
    last_stack_step: int | None = None
    nccl_env: dict = field(default_factory=dict)
    heartbeat_s: float = 0.0  # the recorder's heartbeat interval (0: none, or an older recorder)
    blackbox_fired: bool = True  # its black box holds a row (True where not known: read the file to see)
    buckets: Buckets | None = None  # its series in buckets of steps, for the report (buckets.py)

    @property
    def step_s(self) -> np.ndarray:
        """Each step's wall time: between steps (data wait included), forward, backward, recorder."""
        p = self.phases
        parts = [p["between_steps"] + np.nan_to_num(p["data"]), p["forward"], p["backward"], p["recorder"]]
        return np.nansum(np.vstack(parts), axis=0) if len(self.steps) else np.zeros(0)

    @property
    def own_s(self) -> np.ndarray:
        """Its own work per step: waiting for its data, between steps, its forward (NaN: none timed)."""
        p = self.phases
        own = np.vstack([p["data"], p["between_steps"], p["forward"]])
        return np.where(np.isnan(own).all(axis=0), np.nan, np.nansum(own, axis=0)) if len(self.steps) else np.zeros(0)

    @property
    def last_step(self) -> int | None:
        return int(self.steps[-1]) if len(self.steps) else None


def _reader(rt: RankTrace):
    def col(name: str, dtype=np.float64) -> np.ndarray:  # (a column an older trace lacks: NaN)
        if rt.lacks(f"steps/{name}"):
            return np.full(rt.n_steps, np.nan, dtype=dtype)
        return rt.columns[name].to_numpy(dtype)
    return col


def _timing(col) -> tuple[dict, np.ndarray, str]:
    """A rank's phases (each its own) and memory (its kind) from its steps table."""
    phases = {k: col(c, np.float32) for k, c in PHASE_COLUMNS.items()}
    # The file's between_steps_s includes the data wait: apart here, so each phase is its own.
    phases["between_steps"] = np.where(np.isnan(phases["data"]), phases["between_steps"],
                                       phases["between_steps"] - np.nan_to_num(phases["data"]))
    cuda = col("cuda_peak_bytes")
    if (cuda > 0).any():
        return phases, np.where(cuda >= 0, cuda, np.nan), "cuda_peak"
    rss = col("rss_bytes")
    return phases, np.where(rss >= 0, rss, np.nan), "rss"


def timing_of(rt: RankTrace, ends: bool = False) -> RankDigest:
    """What the straggler's second map reads of a rank again (analyzer/cluster_passes.py): its
    steps, phases and memory, from its steps table alone (not its gradient norms, fingerprints or
    heartbeats: at 200 tensors the gradient norms are most of a digest's read); with ``ends``
    also its fingerprints, heartbeats and end (what counters.py counts)."""
    col = _reader(rt)
    phases, memory, kind = _timing(col)
    nan = np.full(rt.n_steps, np.nan)
    none = np.zeros(0, dtype=np.int64)
    d = RankDigest(rank=int(rt.rank), file=rt.path, steps=np.asarray(rt.step_index, dtype=np.int64),
                   time_unix=nan, loss=nan, phases=phases, grad_norm=nan, local_grad=nan, memory=memory,
                   memory_kind=kind, replicated=False, param_names=[], fp_steps=none, fp_hash=none,
                   closed_cleanly=rt.closed_cleanly, end_reason="")
    if ends:
        for name, value in {**_marks(rt), **_end(rt)}.items():
            setattr(d, name, value)
    return d


def _marks(rt: RankTrace) -> dict:
    """A rank's fingerprint hashes, last heartbeats and last stack."""
    fp_steps = rt.fingerprint_steps
    fp_hash = np.zeros(len(fp_steps), dtype=np.int64)
    if len(fp_steps):
        bits = rt.fingerprint_rows()
        fp_hash = np.array([int.from_bytes(hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=8)
                                           .digest(), "little", signed=True) for row in bits], dtype=np.int64)
    beats, stack, stack_step = _beats(rt)
    return {"fp_steps": fp_steps, "fp_hash": fp_hash, "heartbeats": beats, "last_stack": stack,
            "last_stack_step": stack_step}


def _beats(rt: RankTrace) -> tuple[list[dict], list | None, int | None]:
    """A rank's last MAX_HEARTBEATS heartbeats, its last stack and that stack's step."""
    hb = rt.heartbeats
    if len(hb):  # (a damaged or hostile row: a step or time that is no number is not a heartbeat)
        hb = hb[np.isfinite(hb["step"].astype(float)) & np.isfinite(hb["time_unix"].astype(float))
                & (hb["step"].astype(float).abs() < 2**53)]
    beats, stack, stack_step = [], None, None
    if len(hb):
        with_stack = [i for i, s in enumerate(hb["stack"]) if s is not None]
        if with_stack:
            stack, stack_step = hb["stack"].iloc[with_stack[-1]], int(hb["step"].iloc[with_stack[-1]])
        tail = hb.iloc[-MAX_HEARTBEATS:]
        beats = [{"time_unix": float(t), "step": int(s), "phase": p, "phase_s": float(ps), "step_s": float(ss),
                  "typical_step_s": float(ty)}
                 for t, s, p, ps, ss, ty in zip(tail["time_unix"], tail["step"], tail["phase"], tail["phase_s"],
                                                tail["step_s"], tail["typical_step_s"])]
    return beats, stack, stack_step


def ends_of(rt: RankTrace) -> dict:
    """What the hang figure draws of a rank, read for the few ranks it draws (not kept for every
    rank): the times of its last TAIL steps, its last heartbeats, its last step."""
    steps = rt.step_index
    return {"time_unix": _reader(rt)("time_s")[-TAIL:], "heartbeats": _beats(rt)[0],
            "last_step": int(steps[-1]) if len(steps) else None}


def _end(rt: RankTrace) -> dict:
    """Whether the rank holds whole parameters (replicas compare), their names, how its trace
    ended, its NCCL environment and heartbeat interval."""
    return {"replicated": bool((rt.param_shards == 1).all()), "param_names": list(rt.param_names),
            "end_reason": str(rt.meta.get("end_reason", "")), "nccl_env": rt.nccl_env,
            "heartbeat_s": _seconds(rt.meta.get("config", {}).get("heartbeat_s"))}


def digest_of(rt: RankTrace) -> RankDigest:
    """The digest of one rank (reads its steps table, one pass over its gradient norms, its
    fingerprints and heartbeats)."""
    col = _reader(rt)
    phases, memory, kind = _timing(col)
    marks = _marks(rt)  # (read first, as always: a damaged file says the same first problem)
    d = RankDigest(
        rank=int(rt.rank), file=rt.path,
        steps=np.asarray(rt.step_index, dtype=np.int64), time_unix=col("time_s"),
        loss=col("loss"), phases=phases,
        grad_norm=np.asarray(rt.digest.total_grad_norm, dtype=np.float64), local_grad=col("local_grad_norm"),
        memory=memory, memory_kind=kind, **_end(rt), closed_cleanly=rt.closed_cleanly, **marks,
        blackbox_fired=_fired(rt))
    series = {"own": d.own_s, "backward": d.phases["backward"], "loss": d.loss, "grad_norm": d.grad_norm,
              "memory": d.memory}
    for name in BUCKETED_MEMORY:  # (the report's memory lines of many ranks)
        v = col(f"{name}_bytes")
        series[name] = np.where(v >= 0, v, np.nan)
    d.buckets = Buckets.of(d.steps, series, width_for(d.last_step or 0))
    return d


BUCKETED_MEMORY = ("rss", "cuda_allocated", "cuda_reserved")


def _fired(rt: RankTrace) -> bool:
    """Whether the rank's black box fired (told in the digest so the reports need not open every
    rank's file again to find the one that did)."""
    try:
        return bool(len(rt.blackbox))
    except TraceError:
        return True  # (the reports read it and say what is wrong)


def _seconds(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 else 0.0
