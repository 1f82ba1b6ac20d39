"""RankTrace's readers of what a many-rank job needs: the heartbeats a rank wrote while no step
came (recorder/distributed/heartbeat.py), its replica fingerprints (recorder/distributed/fingerprint.py) and the NCCL
flight recorder's settings of its environment. Absent from older traces: they read as empty."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import pandas as pd

from .format import parse_json
from .phases import PHASES
MAX_FRAMES = 64


def parse_stack(text: str) -> list[tuple[str, int, str, str]] | None:
    """A heartbeat's stack: [(file, line, function, code), ...] innermost last; None if absent or
    not a stack (a damaged or hostile trace: never more than MAX_FRAMES frames, strings cut)."""
    if not text:
        return None
    frames = parse_json(text)
    if not isinstance(frames, list):
        return None
    out = []
    for fr in frames[-MAX_FRAMES:]:
        if not (isinstance(fr, list) and len(fr) == 4 and isinstance(fr[1], int)
                and all(isinstance(x, str) for x in (fr[0], fr[2], fr[3]))):
            return None
        out.append((fr[0][:400], int(fr[1]), fr[2][:200], fr[3][:200]))
    return out or None


class Liveness:
    """Mixed into RankTrace."""

    @cached_property
    def heartbeats(self) -> pd.DataFrame:
        """One row per heartbeat (rows only while no step came): time_unix, step (in progress),
        phase (one of PHASES; "" if unknown), phase_s, step_s, typical_step_s, stack (a list of
        (file, line, function, code) frames, innermost last, or None)."""
        cols = ("time_unix", "step", "phase", "phase_s", "step_s", "typical_step_s", "stack")
        df = self._texts_table("heartbeats", cols, ("phase", "stack"))
        df["phase"] = [p if p in PHASES else "" for p in df["phase"]]
        df["stack"] = [parse_stack(s) for s in df["stack"]]
        return df

    @cached_property
    def fingerprint_steps(self) -> np.ndarray:
        """The steps with replica fingerprints (after their optimizer step)."""
        if not self._has("fingerprints"):
            return np.zeros(0, dtype=np.int64)
        n = self._n_rows("fingerprints", ("step", "bits"))
        if self._width_of("fingerprints/bits") != len(self.param_names):
            return np.zeros(0, dtype=np.int64)  # (not one per parameter: damaged; not compared)
        return self._read("fingerprints/step", n, ndim=1).astype(np.int64)

    def fingerprint_rows(self, rows=None) -> np.ndarray:
        """The fingerprints (int64, one per parameter) of those rows of fingerprint_steps."""
        n = len(self.fingerprint_steps)
        _, bits = self._read_rows("fingerprints/bits", rows, n)
        return bits.astype(np.int64, copy=False)

    @property
    def nccl_env(self) -> dict[str, str]:
        """The NCCL flight recorder's settings in the job's environment (recorder/trace_file/header.py)."""
        env = parse_json(self.meta.get("nccl_env", "") or "{}")
        if not isinstance(env, dict):
            return {}
        return {str(k)[:100]: str(v)[:512] for k, v in env.items() if isinstance(v, str)}
