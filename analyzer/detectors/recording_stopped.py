"""recording_stopped: the recorder hit an error of its own and stopped; the training went on.

The recorder never raises into the training: on an internal error it warns once, closes the
trace with ``end_reason`` "recorder error: ..." and lets the job run unrecorded. Such a trace
holds only the steps before the error, so a clean analysis of it would say "no problem found"
about steps it never saw. This finding says where the recording stopped, why, and what the
analysis could judge (the steps before it) and could not (everything after).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace


@dataclass(frozen=True)
class RecordingStoppedConfig:
    pass


class Evidence(BaseEvidence, total=False):
    reason: str  # the recorder's error, as the trace's end_reason holds it
    steps_recorded: int  # steps the trace holds
    stopped_at_step: int  # the step in progress when recording stopped: the first not recorded


KIND = "recording_stopped"
REQUIRES = ()
CONFIG = RecordingStoppedConfig  # (no thresholds)
ORDER = 1  # first among findings of its step: it says what the others could see

_PREFIX = "recorder error"


def detect(rt: RankTrace, cfg: RecordingStoppedConfig) -> list[Finding]:
    reason = str(rt.meta.get("end_reason", "") or "")
    if not rt.closed_cleanly or not reason.startswith(_PREFIX):
        return []
    error = reason[len(_PREFIX):].lstrip(": ") or "unknown"
    n = int(rt.n_steps)
    stopped = int(rt.step_index[-1]) + 1 if n else _int(rt.meta.get("n_steps_recorded"))
    if n:
        seen = (f"the analysis covers the {n:,} step{'s' * (n != 1)} recorded before it "
                f"({int(rt.step_index[0]):,}-{stopped - 1:,}) and cannot see what happened after")
    else:
        seen = "no step was recorded, so nothing about the training could be checked"
    summary = (f"Recording stopped at step {stopped:,}: the recorder failed ({error}) and the training went on "
               f"unrecorded; {seen}.")
    advice = ("This is a fault of torchautopsy, not of the training: report it with this line (the job's output "
              "has the same one-line warning). Meanwhile record again with the part that failed turned off, if "
              "the error names one (each schedule is a Recorder keyword; 0 turns it off), or with a plain "
              "eager model if it failed under torch.compile.")
    return [Finding(KIND, "warning", stopped, [], summary,
                    {"reason": error[:1000], "steps_recorded": n, "stopped_at_step": stopped}, advice)]


def _int(value) -> int:
    """A step number from the trace's attributes (untrusted: 0 when it is not one)."""
    try:
        return max(0, int(value))
    except (TypeError, ValueError, OverflowError):
        return 0
