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
  The Recorder lines its probes up with that step through the probe protocol (``align``,
  probe.py): activity windows, update-ratio samples, histograms, profiler windows start from
  it, and the opening parameter snapshot is labelled with it (taken again, once the step is
  known, if it was unknown when the Recorder opened: the weights are then those a checkpoint
  restored). ``StartStep`` holds the search, told what to do by callables: it never touches
  the Recorder.
"""

from __future__ import annotations

import os
import re
import warnings
import weakref
from dataclasses import dataclass

from ..optimizer.global_hooks import on_pre_step

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

def restarted(run_dir: str, rank: int) -> bool:
    """An earlier attempt of this rank has published its trace in run_dir."""
    try:
        return any(_attempts(run_dir, str(rank)).values())
    except OSError:  # (no run directory yet: a first attempt)
        return False


class StartStep:
    """The step number of an attempt's first rec.step(): Recorder option start_step; on a restart
    without it, 0 until an optimizer of the model shows a restored step count (search); else 0.
    The Recorder asks ``pending`` at each rec.step() and close(), and calls finish() at the first."""

    def __init__(self, start_step: int | None, restarted: bool):
        self.auto = start_step is None and restarted  # start_step not given: read it from the optimizer
        self.start = start_step or 0
        self.pending = self.auto  # the first rec.step() or close() is still to come
        self._done = not self.auto  # the step is known, or no longer looked for
        self._held = None  # the opening snapshot's writer task, until its step is known
        self._error: Exception | None = None  # raised in the optimizer hook, reported at rec.step()
        self._index: dict = {}
        self._is_first = self._resume_at = self._hand_over = None

    def search(self, param_index: dict, held, *, is_first, resume_at, hand_over) -> None:
        """Look for the step at the model's optimizer's first step (before the Recorder's own
        optimizer hook). ``held``: the opening snapshot's writer task (or None); ``is_first()``:
        the recorder records and its first step has not ended; ``resume_at(s, held)``: the
        optimizer restored s steps; ``hand_over(task)``: write the held snapshot as it is."""
        self._index, self._held = param_index, held
        self._is_first, self._resume_at, self._hand_over = is_first, resume_at, hand_over
        _waiting.add(self)

    def _pre_step(self, optimizer) -> None:
        if self._done or not self._is_first():
            return  # (rec.step() or close() ends the search)
        try:
            count = _optimizer_step(optimizer, self._index)
            if count is None:
                return  # another model's optimizer
            self._done = True
            held, self._held = self._held, None
            if count > 0:  # this iteration, the first recorded, is step `count`
                self._resume_at(count, held is not None)
            elif held is not None:
                self._hand_over(held)
        except Exception as e:  # (failed at rec.step() or close(): reported with the step)
            self._error, self._done = e, True

    def finish(self, fail) -> None:
        """The first rec.step() or close(): the search is over (``fail``: the Recorder's)."""
        self.pending = False
        _waiting.discard(self)
        if self._error is not None:
            fail(self._error)
        if not self._done:
            self._done = True
            held, self._held = self._held, None
            try:
                if held is not None:  # the opening snapshot's step is the start: write it
                    self._hand_over(held)
            except Exception as e:
                warnings.warn(f"torchautopsy: the opening snapshot could not be kept ({e!r})", RuntimeWarning,
                              stacklevel=3)


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


# Searches whose first step's number is not known yet, and the optimizer pre-hook that looks for it,
# subscribed once, when the recorder is imported: before any Recorder's own
# (optimizer/global_hooks.py keeps their order), so the step is renumbered before the black box's
# hook can capture a step. With no search waiting it returns at once.
_waiting: weakref.WeakSet = weakref.WeakSet()


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    if _waiting:
        for search in list(_waiting):
            search._pre_step(optimizer)
    return None


on_pre_step(_on_optimizer_step)
