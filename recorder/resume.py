"""Restarts: a job pre-empted and restarted into the same run directory.

Two things, both so that the first attempt's trace (often the one that holds the failure) is
never lost and the attempts line up on one step axis:

- **A file per attempt.** ``reserve()`` gives each Recorder of a rank a name no other process
  can take: ``rank{N}.h5`` for the first, then ``rank{N}.attempt{K}.h5``, K = 2, 3, ...
  The name is reserved by creating ``<name>.starting`` with O_CREAT|O_EXCL (which one process
  only can do) and checking that ``<name>`` is not there yet; ``publish()`` then hard-links
  the built file to ``<name>``, which fails rather than replace a file (os.replace would
  overwrite). A publisher creates ``<name>`` before it removes ``<name>.starting``, so one of
  the two always exists from the reservation on: a later process never takes the name again.

- **Resumed step numbers.** The first ``rec.step()`` of an attempt is step ``start_step`` when
  given. Otherwise, on a restart only (an earlier attempt's trace of this rank is in the run
  directory), it is the step count an optimizer of the model restored from its checkpoint, read
  the first time that optimizer steps (Adam-family ``state[p]["step"]``; SGD keeps none). A
  first attempt counts from 0, as the README says, however long its optimizer trained before.
  ``begin()`` and ``_resume_at()`` line the schedules up with that step: activity
  windows, update-ratio samples, histograms, profiler windows start from it, and the opening
  parameter snapshot is labelled with it (taken again, once the step is known, if it was
  unknown when the Recorder opened: the weights are then those a checkpoint restored).
"""

from __future__ import annotations

import os
import re
import warnings
import weakref
from dataclasses import dataclass

from .optimizer_hooks import on_pre_step

STARTING_SUFFIX = ".starting"  # (the analyzer knows it too: trace/format.py)
# rank{N}.h5 (attempt 1) or rank{N}.attempt{K}.h5 (K >= 2), optionally still .starting
_NAME = re.compile(r"^rank(\d+)(?:\.attempt(\d+))?\.h5(?:\.starting)?$")
_MAX_ATTEMPTS = 100_000


@dataclass(frozen=True)
class Slot:
    path: str  # the attempt's trace file, published once built
    starting: str  # path + ".starting": reserved (an empty file), built there
    attempt: int  # 1 for rank{N}.h5
    previous: str  # file name of the newest earlier attempt's trace ("" if none)


def attempt_name(rank_stem: str, attempt: int) -> str:
    return f"{rank_stem}.h5" if attempt == 1 else f"{rank_stem}.attempt{attempt}.h5"


def _attempts(run_dir: str, rank: str) -> dict[int, bool]:
    """{attempt: published} of the names a rank's attempts took in run_dir so far."""
    out: dict[int, bool] = {}
    for name in os.listdir(run_dir):
        m = _NAME.match(name)
        if m and m.group(1) == rank and m.group(2) != "1":  # (attempt1 is never written)
            k = int(m.group(2) or 1)
            out[k] = out.get(k, False) or not name.endswith(STARTING_SUFFIX)
    return out


def reserve(path: str) -> Slot:
    """The name of this attempt's trace, for ``path`` = run_dir/rank{N}.h5: that name if no
    attempt of rank N was there yet, else the next ``rank{N}.attempt{K}.h5``."""
    run_dir, base = os.path.split(os.path.abspath(path))
    m = _NAME.match(base)
    if m is None or m.group(2) is not None or base.endswith(STARTING_SUFFIX):
        return Slot(path, path + STARTING_SUFFIX, 1, "")  # another name (a benchmark's): as given
    rank = m.group(1)
    seen = _attempts(run_dir, rank)
    # After the newest name taken (even a dead .starting, or one whose earlier files were
    # deleted): attempt numbers keep the order the attempts started in.
    k = max(seen, default=0) + 1
    for k in range(k, k + _MAX_ATTEMPTS):
        final = os.path.join(run_dir, attempt_name(f"rank{rank}", k))
        starting = final + STARTING_SUFFIX
        try:
            fd = os.open(starting, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue  # another process holds it
        os.close(fd)
        if os.path.lexists(final):  # published after our listing: not ours to take
            os.unlink(starting)
            continue
        earlier = [j for j, published in _attempts(run_dir, rank).items() if published and j < k]
        previous = attempt_name(f"rank{rank}", max(earlier)) if earlier else ""
        return Slot(final, starting, k, previous)
    raise OSError(f"{run_dir}: no free attempt name for rank {rank}")


def publish(starting: str, final: str) -> None:
    """Give the built file its name without ever replacing a file there."""
    try:
        os.link(starting, final)  # FileExistsError rather than overwrite
    except FileExistsError:
        raise
    except OSError:
        # A file system without hard links: rename, which the reservation keeps from
        # overwriting a cooperating recorder's file.
        if os.path.lexists(final):
            raise FileExistsError(f"{final} appeared while this attempt's trace was built; "
                                  "not written over") from None
        os.rename(starting, final)
        return
    os.unlink(starting)


def closing_attrs(attrs: dict, first: int) -> dict:
    """The attributes written at close: a resumed attempt says its first step, and counts
    its own steps in n_steps_recorded (rec._step is first + steps)."""
    if first:
        attrs = {**attrs, "first_step": first}
        if isinstance(attrs.get("n_steps_recorded"), int):
            attrs["n_steps_recorded"] = max(0, attrs["n_steps_recorded"] - first)
    return attrs


# -- step numbers ---------------------------------------------------------------------------------

class _State:
    def __init__(self, auto: bool):
        self.auto = auto  # start_step not given: read it from the optimizer
        self.start = 0
        self.held = None  # the opening snapshot's writer task, until its step is known
        self.done = not auto
        self.error: Exception | None = None  # raised in the optimizer hook, reported at rec.step()


def _restarted(run_dir: str, rank: int) -> bool:
    """An earlier attempt of this rank has published its trace in run_dir."""
    try:
        return any(_attempts(run_dir, str(rank)).values())
    except OSError:  # (no run directory yet: a first attempt)
        return False


def first_step(rec) -> int:
    """The step number of rec's first rec.step(): Recorder option start_step; on a restart
    without it, 0 until an optimizer of the model shows a restored step count
    (_on_optimizer_step); else 0."""
    start = rec.config.start_step
    state = rec._resume = _State(auto=start is None and _restarted(rec.run_dir, rec.rank))
    state.start = start or 0
    if state.auto:
        _waiting.add(rec)
        # The first rec.step() or close() ends the search (and hands over the held snapshot):
        # seen through instance attributes, removed at their first call, so that
        # Recorder.step itself stays as it is.
        rec.step = lambda loss=None: _finish(rec, "step", loss)
        rec.close = lambda reason="closed": _finish(rec, "close", reason)
    return state.start


def begin(rec) -> None:
    """At the end of Recorder._open: the first step's schedule and profiler window, and the
    opening snapshot (parameters at the start of the first step)."""
    state, s = rec._resume, rec._step
    if s:
        _align(rec, s)
    rec._set_schedule(s)
    rec.profiler.begin(s)
    if rec.captures.snapshots is None:
        return
    if state.auto:  # its step is not known yet: copied now, written once known
        state.held = rec.captures.snapshots.take(s)
        rec.captures.last_snapshot = s
    elif rec.captures.snapshots.due(s) or s:  # every attempt keeps the state it started from
        rec.captures.snapshot(s)


def _align(rec, s: int) -> None:
    """Schedules that count from step 0 start from step s instead (the start of an attempt,
    as step 0 is of a run)."""
    # The first update ratio at s + 1, against a copy taken at the end of step s: a copy taken
    # when the Recorder opened may predate the checkpoint's weights.
    rec.planner.align(s)
    act = rec.activity
    act._window_start, act.step = s, s
    act.last_step = act._last_step()
    rec.attention.step = s
    for site in (*act._new_sites, *rec.attention._new_sites):  # seen in this first forward
        site["first_step"] = max(site["first_step"], s)
    prof = rec.profiler
    prof.first += s  # after this attempt's warm-up
    # A window opened (or due) at the first step was labelled 0: it is the window of step s.
    for name in ("_start_step", "_window_due", "_due"):
        if getattr(prof, name, -1) >= 0:
            setattr(prof, name, max(getattr(prof, name), s))
    if rec.writer is not None:
        rec.writer.first_step = s


def _optimizer_step(optimizer, index: dict) -> int | None:
    """The step count an optimizer of the model holds (the largest over its parameters), 0 if
    it keeps none (SGD), None if it holds no parameter of the model."""
    mine, count = False, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in index:
                continue
            mine = True
            st = optimizer.state.get(p)
            step = st.get("step") if isinstance(st, dict) else None
            if step is not None:
                count = max(count, int(step.item() if hasattr(step, "item") else step))
    return count if mine else None


# Recorders whose first step's number is not known yet, and the optimizer pre-hook that looks for
# it, subscribed once, when the recorder is imported: before any Recorder's own (optimizer_hooks.py
# keeps their order), so the step is renumbered before the black box's hook can capture a step.
# With no Recorder waiting it returns at once.
_waiting: weakref.WeakSet = weakref.WeakSet()


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    if _waiting:
        for rec in list(_waiting):
            _pre_step(rec, optimizer)
    return None


on_pre_step(_on_optimizer_step)


def _pre_step(rec, optimizer) -> None:
    state = rec._resume
    if state.done:
        return None
    if not getattr(rec, "_active", False) or rec._step != state.start:
        return None  # (rec.step() or close() ends the search)
    try:
        count = _optimizer_step(optimizer, rec._param_index)
        if count is None:
            return None  # another model's optimizer
        state.done = True
        if count > 0:
            _resume_at(rec, count)
        else:
            _hand_over(rec)
    except Exception as e:  # (failed at rec.step() or close(): reported with the step)
        state.error, state.done = e, True
    return None


def _resume_at(rec, s: int) -> None:
    """The optimizer restored s steps: this iteration, the first recorded, is step s."""
    state = rec._resume
    rec._step = s
    _align(rec, s)
    if rec.captures.snapshots is not None:
        if state.held is not None and rec.captures.snapshots.count == 1:
            rec.captures.snapshots.count = 0  # its slot was never written: the new one takes slot 0
        state.held = None
        # The parameters at the start of step s, now that a checkpoint has been loaded (the
        # buffers after this step's forward: BatchNorm statistics moved by one batch).
        rec.captures.snapshot(s)


def _hand_over(rec) -> None:
    """The opening snapshot's step is the start: write it."""
    state = rec._resume
    task, state.held = state.held, None
    if task is not None and rec.writer is not None and rec._active:
        rec.writer.put_task(task)


def _finish(rec, method: str, arg):
    """The first rec.step() or close(): the search for a resumed step is over."""
    state = rec._resume
    rec.__dict__.pop("step", None)
    rec.__dict__.pop("close", None)
    if state.error is not None:
        rec._fail(state.error)
    if not state.done:
        state.done = True
        try:
            _hand_over(rec)
        except Exception as e:
            warnings.warn(f"torchautopsy: the opening snapshot could not be kept ({e!r})", RuntimeWarning,
                          stacklevel=3)
    _waiting.discard(rec)
    return getattr(rec, method)(arg)
