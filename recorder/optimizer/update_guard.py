"""Before each optimizer step: the gradients of the recorded model are judged (their norms taken
once, grad_norms.py, reused at rec.step()) and, if one is NaN/Inf, the black box fires while the
parameters are still those the bad step started from (blackbox/captures.py). Subscribed to every
optimizer's step (a global pre-hook, global_hooks.py) only when the black box is on."""

from __future__ import annotations

from ..profiler.profile_windows import own_work
from . import global_hooks


class UpdateGuard:
    def __init__(self, norms, captures, origin, watcher, param_names: list[str], name_by_id: dict, *,
                 step_now, active, watched, fail):
        """``step_now()`` the step in progress, ``active()`` the recorder records, ``watched()``
        the step has every module hooked, ``fail(e)`` the recorder's failure."""
        self._norms, self._captures, self._origin, self._watcher = norms, captures, origin, watcher
        self._names, self._name_by_id = param_names, name_by_id
        self._step_now, self._active, self._watched, self._fail = step_now, active, watched, fail
        self._hook = global_hooks.on_pre_step(self._pre_step) if captures.blackbox is not None else None

    def _pre_step(self, optimizer, args, kwargs):
        """Not for a step given a closure (Lightning, LBFGS): its forward and backward run inside
        optimizer.step(), after this hook, which would judge the last step's gradients.
        Lightning's callback calls Recorder.before_optimizer_step() once the closure's backward
        is done; elsewhere such a step's gradients are measured at rec.step(), and a NaN in them
        fires the black box there."""
        if callable(kwargs.get("closure", args[0] if args else None)):
            return None
        self.judge(optimizer)
        return None

    def judge(self, optimizer) -> None:
        if not self._active() or not self._captures.armed:
            return
        try:
            with own_work():
                step = self._step_now()
                bad = self._norms.judge(optimizer, step)
                if bad:  # NaN/Inf gradients, not yet applied: the black box now
                    names = [self._names[i] for i in bad]
                    extra = {"n_params_affected": len(names), **self._replay()}
                    bb = self._captures.blackbox
                    self._captures.fire(bb.capture(step, "grad_nonfinite", "start_of_step", optimizer, names,
                                                   self._name_by_id, extra))
        except Exception as e:
            self._fail(e)

    def _replay(self) -> dict:
        """On a step that was not watched (or whose compiled forward hid its inner modules), find
        where its NaN/Inf was born by running its forward passes again on a copy of the model
        (before the black box is written: it says how it went)."""
        if self._watched() and not self._watcher.compiled:
            return {}
        return self._origin.replay(self._captures.blackbox)

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
