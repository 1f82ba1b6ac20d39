"""The tensors a trace keeps whole, and when: parameter snapshots on a schedule, sampled
activations and gradients (whole_tensors.py), and the black box (black_box.py), which fires once, on the
first step that goes NaN/Inf, or when the job leaves by an exception or SIGTERM."""

from __future__ import annotations

import math
import warnings

from ..probe import Probe, StepPlan
from .black_box import BlackBox
from .whole_tensors import Samples, Snapshots


class Captures(Probe):
    def __init__(self, model, watcher, cfg, writer, on_error):
        self.writer = writer
        self.snapshots = Snapshots(model, cfg.snapshot_every, cfg.snapshot_budget_bytes, cfg.snapshot_dtype) \
            if cfg.snapshot_every else None
        self.last_snapshot = -1
        self.samples = None
        if cfg.sample_every:
            self.samples = Samples(cfg.sample_every, cfg.sample_rows, cfg.sample_max_elements,
                                   cfg.sample_budget_bytes, on_error)
            watcher.sample_outputs(self.samples, sample_sites(watcher, cfg.sample_modules))
        self.blackbox = BlackBox(model, on_error) if cfg.blackbox else None

    # -- the probe protocol (probe.py) --------------------------------------------------------
    def arm(self, plan: StepPlan) -> None:
        if self.blackbox is not None:
            self.blackbox.arm(plan.watched)

    def close(self) -> None:
        self.remove()

    def opening_snapshot(self, step: int, known: bool):
        """The parameters the attempt starts from, as step ``step``. Written now if the step is
        ``known``; else returned as a writer task to hand over once it is (trace_file/attempts.py),
        or None."""
        if self.snapshots is None:
            return None
        if not known:
            self.last_snapshot = step
            return self.snapshots.take(step)
        if self.snapshots.due(step) or step:  # every attempt keeps the state it started from
            self.snapshot(step)
        return None

    def resumed_at(self, step: int, held: bool) -> None:
        """A checkpoint was loaded: the opening snapshot again, as step ``step``, in the slot of
        the one ``held`` back (never written)."""
        if self.snapshots is None:
            return
        if held:
            self.snapshots.forget_unwritten()
        # The parameters at the start of step s, now that a checkpoint has been loaded (the
        # buffers after this step's forward: BatchNorm statistics moved by one batch).
        self.snapshot(step)

    @property
    def armed(self) -> bool:
        return self.blackbox is not None and self.blackbox.armed

    def snapshot(self, step: int) -> None:
        task = self.snapshots.take(step)
        self.last_snapshot = step
        if task is not None:
            # Never stalls training: a writer so far behind that its queue is full drops it.
            # (At creation and at close the queue is empty or drained anyway.)
            self.writer.put_task(task)

    def fire(self, task) -> None:
        """Write the black box now, and wait for it to be on disk: the job may die next."""
        self.writer.put_task(task, timeout=30.0)
        self.writer.flush(timeout=120.0)

    def after_step(self, step: int, trigger: str | None, replay: str | None) -> None:
        """The step's sampled tensors, and the black box if the step broke without an optimizer
        step seeing it (NaN loss or output with finite gradients, a manual update)."""
        if self.samples is not None:
            task = self.samples.take(step)
            if task is not None:
                self.writer.put_task(task)
        if trigger is not None:
            self.fire(self.blackbox.capture(step, trigger, "end_of_step", extra={
                "note": "seen at rec.step(), after this step's update: no optimizer step saw NaN/Inf "
                        "gradients first (a NaN loss or output with finite gradients, or a hand-written update)",
                **({"origin_replay": replay} if replay else {})}))
        self.end_step(step)

    def end_step(self, step: int) -> None:
        """The black box forgets the step; the parameters are snapshotted if the next step is due."""
        if self.blackbox is not None:
            self.blackbox.new_step()
        if self.snapshots is not None and self.snapshots.due(step + 1):
            self.snapshot(step + 1)

    def at_close(self, step: int, reason: str) -> None:
        """The black box if the job is leaving by an exception or SIGTERM (and it has not fired),
        and the final parameters as a snapshot."""
        try:
            if self.armed and (reason.startswith("exception") or reason == "sigterm"):
                self.fire(self.blackbox.capture(step, reason.split(":")[0], "at_exit", extra={"reason": reason}))
            if self.snapshots is not None and self.last_snapshot != step and step > 0:
                self.snapshot(step)
        except Exception as e:
            warnings.warn(f"torchautopsy: the final snapshot or black box could not be taken ({e!r})",
                          RuntimeWarning, stacklevel=4)

    def note(self) -> dict:
        """The trace's closing attributes: why snapshots stopped, if they did."""
        return {"snapshot_note": self.snapshots.skipped} if self.snapshots and self.snapshots.skipped else {}

    def remove(self) -> None:
        if self.blackbox is not None:
            self.blackbox.remove()


def trigger(loss_given: bool, loss_value: float, grad_bad, mods: dict, optimizer_judges) -> str | None:
    """Why the black box fires at rec.step() on a bad step, or None. ``optimizer_judges()``: an
    optimizer step of this model was seen (or AMP's GradScaler skipped this one), so NaN/Inf
    gradients it never saw were not applied, and are no reason to fire (asked only then)."""
    return ("loss_nonfinite" if loss_given and not math.isfinite(loss_value) else
            "grad_nonfinite" if (grad_bad > 0).any() and not optimizer_judges() else
            "activation_nonfinite" if mods["origin"] >= 0 else
            "input_nonfinite" if mods["batch_nonfinite"] else None)


def sample_sites(watcher, wanted: list[str] | None) -> dict[int, str]:
    """{module index: name} of the modules whose tensors are sampled: those named, or the first,
    middle and last leaf modules computing with their own weights."""
    names = watcher.names
    if wanted is not None:
        chosen = [names.index(m) for m in wanted]
    else:
        weighted = [i for i in range(len(names)) if watcher.is_leaf[i] and watcher.has_weights[i]]
        chosen = sorted({weighted[0], weighted[len(weighted) // 2], weighted[-1]}) if weighted else []
    return {i: names[i] for i in chosen}


def check_sample_modules(model, wanted: list[str] | None) -> None:
    """Recorder option sample_modules names modules of this model, or the Recorder refuses it."""
    if wanted is None:
        return
    known = {n for n, _ in model.named_modules()}
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise ValueError(f"Recorder option sample_modules: no module named {', '.join(map(repr, unknown))} "
                         f"in the model (names as model.named_modules() spells them)")
