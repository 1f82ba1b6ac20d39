"""Where a bad step's NaN/Inf was born: among a watched step's module calls (born_where, from
forward/module_watcher.py's checks); when the module hooks did not watch it, the black box's
replay of the step on a copy of the model (replay.py); a -Inf that went into the loss; and what
the loss function did (loss_graph.py: the root's hook gives it each training forward's outputs,
forward/root_hooks.py). The recorder asks it on the steps that go bad."""

from __future__ import annotations

import json
import math

from ..probe import Probe, StepPlan
from .loss_graph import loss_ops, mark_outputs, outputs_nonfinite

MAX_LOSS_CHECKS = 3  # bad steps whose loss function is examined: the first is the one that matters


class NanOrigin(Probe):
    def __init__(self):
        self.replayed: dict | None = None  # this step's replay (replay.py), if it ran
        self._loss_checks = 0
        self._out_refs: list = []  # weak references to the step's last training forward's outputs

    def arm(self, plan: StepPlan) -> None:
        self.replayed = None
        self._out_refs = []

    def on_training_output(self, output) -> None:
        self._out_refs = mark_outputs(output)

    def forget_outputs(self) -> None:
        self._out_refs = []

    def replay(self, blackbox) -> dict:
        """Run the step's forward passes again on a copy of the model, once a step (before the
        black box is written: it says how it went)."""
        if self.replayed is not None or blackbox is None:
            return {}
        self.replayed = blackbox.replay()
        return {"origin_replay": self.replayed["replay"]}

    def merge(self, mods: dict, loss_bad: bool, grads_bad: bool) -> dict:
        """The watcher's row of the step, with what the replay found (a reproduced replay's row;
        else only the maker of a -Inf it saw) and, when no module made NaN/+Inf, the module whose
        -Inf went into the loss (the loss went NaN/Inf), or into a layer that hid it in the
        forward (a GRU's saturated gates) and made NaN of it in the backward (the loss finite, the
        gradients not, unless the gradient reaching the model's outputs was bad already: the
        loss's backward made it)."""
        r = self.replayed
        if r is not None:
            keys = ("output_absmax", "origin", "consumer", "neg_origin", "batch_nonfinite") \
                if r.get("reproduced") else ("neg_origin", "output_grad_nonfinite")
            mods = {**mods, **{k: r[k] for k in keys if k in r}}
        hidden = grads_bad and mods.get("output_grad_nonfinite", -1) != 1
        if mods.get("neg_origin", -1) != -1 and mods["origin"] < 0 and not mods["batch_nonfinite"] \
                and (loss_bad or hidden):
            mods = {**mods, "origin": max(mods["neg_origin"], -1), "batch_nonfinite": int(mods["neg_origin"] == -2)}
        return mods

    def loss_check(self, step: int, loss) -> list[dict]:
        """The loss_checks row of a bad step (the first MAX_LOSS_CHECKS), read now while the loss's
        graph and the model's outputs may still be alive; [] after those."""
        if self._loss_checks >= MAX_LOSS_CHECKS:
            return []
        self._loss_checks += 1
        return [{"step": step, "outputs_nonfinite": outputs_nonfinite(self._out_refs),
                 "ops": json.dumps(loss_ops(loss))}]


def loss_is_bad(loss, loss_value: float) -> bool:
    return loss is not None and not math.isfinite(loss_value)


_BATCH = -2  # (the -Inf came with the input batch)


def born_where(calls: list, amax: list, bad_l: list, neg_l: list, faults: bool, n_modules: int,
               inside) -> tuple[list, int, int, int, bool]:
    """Where a watched step's NaN/Inf was born, from its calls in the order they returned
    (forward/module_watcher.py's ModuleWatcher.finish_step): (max |output| per module, -1 if not
    called; origin, consumer, neg_origin, batch_bad). ``calls``: (module, input checks, output
    checks); ``amax``, ``bad_l``, ``neg_l``: per check, its max |x|, NaN/+Inf, -Inf;
    ``inside(a, b)``: module a is inside module b. Plain Python over the calls: a few values each,
    where numpy's per-call cost dominates."""
    out_absmax = [-1.0] * n_modules  # -1: not called this step
    origin, consumer, first_bad, batch_bad = -1, -1, -1, False
    first_neg = last_neg = -1  # the first and the latest module that made a -Inf from finite inputs
    made_neg: dict[int, int] = {}  # tensor (pair index) holding -Inf -> the module that made it
    neg_makers: list[int] = []  # the modules that made a -Inf from finite inputs, in order
    if faults:  # (the root's call completes last: its inputs, the batch, are seen first here)
        for module, ins, _ in calls:
            if module == 0:
                made_neg.update((i, _BATCH) for i in ins if neg_l[i])
    for module, ins, outs in calls:
        vals = [amax[o] for o in outs]
        a = math.nan if any(v != v for v in vals) else max(vals)  # v != v: NaN
        prev = out_absmax[module]
        out_absmax[module] = a if prev < 0 else (math.nan if prev != prev or a != a else max(a, prev))
        if not faults:
            continue
        in_bad = any(bad_l[i] for i in ins)
        in_neg = [i for i in ins if neg_l[i]]
        if module == 0 and in_bad:
            batch_bad = True
        if any(bad_l[o] for o in outs):
            if first_bad < 0:
                first_bad = module
            if origin < 0 and not in_bad:
                if not in_neg:
                    origin = module  # born here, from finite inputs ...
                    inner = [m for m in neg_makers if inside(m, module)]
                    if inner:  # ... unless a -Inf a submodule made went into it (cat, arithmetic)
                        origin, consumer = inner[-1], module
                else:  # a -Inf made a fault here: the module that made it is the origin
                    # (that tensor's maker; else, after ops outside the modules, the last
                    # module that made a -Inf from finite inputs)
                    origin, consumer = made_neg.get(in_neg[0], last_neg if last_neg >= 0 else module), module
        elif not in_bad and not in_neg and any(neg_l[o] for o in outs):
            for o in outs:
                if neg_l[o]:
                    made_neg.setdefault(o, module)
            if first_neg < 0:
                first_neg = module
            last_neg = module
            neg_makers.append(module)
    # Should the step's loss be NaN/Inf with no module output NaN/+Inf, a -Inf went into it
    # outside the modules (a sum, the loss function): its maker, or the batch, is the origin
    # (the recorder decides at rec.step(), where the loss is known: neg_origin).
    neg_origin = -1
    if first_bad < 0:
        neg_origin = first_neg if first_neg >= 0 else (_BATCH if _BATCH in made_neg.values() else -1)
    if origin == _BATCH:  # a -Inf of the input batch made the fault
        origin, batch_bad = -1, True
    return out_absmax, origin if origin >= 0 else first_bad, consumer, neg_origin, batch_bad
