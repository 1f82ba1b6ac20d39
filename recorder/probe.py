"""The probes' one protocol: what the conductor (recorder.py, step_rows.py) asks of each probe.

A probe measures one thing (gradient norms, module outputs, unit activity, attention, the batch,
the forward's time and mode, ...). The conductor never writes a probe's fields and a probe never
reaches into the conductor: it is built with what it needs (the config, the watcher, the writer,
a failure callback) and is told everything else through these five calls, each a no-op here:

- ``arm(plan)``: the coming step records what ``plan`` says (end of the step before; every step,
  so it must cost next to nothing when nothing changes: most steps are plain);
- ``pack(packer, plan)``: add its device-side reductions to the step's one transfer;
- ``rows(plan, host)``: the rows it makes of the host values, {table: rows};
- ``align(step)``: a resumed attempt's first step is ``step``, not 0 (trace_file/attempts.py): schedules that
  count from step 0 count from it;
- ``close()``: unhook and let go (the Recorder's close, or its failure).

cockpit's ``Cockpit`` loops ``for q in self.quantities: q.track(...)`` the same way.
"""

from __future__ import annotations

from typing import NamedTuple


class StepPlan(NamedTuple):
    """What one step records, decided by the planner before the step runs (a tuple: made every
    step, it costs a third of a frozen dataclass)."""

    step: int
    activations: bool = False  # every module's outputs, units and attention heads measured
    histograms: bool = False  # histograms of the chosen modules' outputs
    tensors: bool = False  # whole outputs of the sampled modules (blackbox/whole_tensors.py)
    watched: bool = False  # every module hooked (forward/module_watcher.py): any of the three (plan())


def plan(step: int, activations: bool, histograms: bool, tensors: bool) -> StepPlan:
    return StepPlan(step, activations, histograms, tensors, activations or histograms or tensors)


class Probe:
    """The protocol, each call a no-op: a probe overrides the calls it needs."""

    def arm(self, plan: StepPlan) -> None:
        pass

    def pack(self, packer, plan: StepPlan) -> None:
        pass

    def rows(self, plan: StepPlan, host: dict) -> dict:
        return {}

    def align(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


PROTOCOL = ("arm", "pack", "rows", "align", "close")
