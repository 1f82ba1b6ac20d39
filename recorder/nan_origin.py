"""Where a bad step's NaN/Inf was born when the module hooks did not watch it: the black box's
replay of the step on a copy of the model (replay.py), a -Inf that went into the loss (hooks.py),
and what the loss function did (loss_graph.py). The recorder asks it on the steps that go bad."""

from __future__ import annotations

import json
import math

from .loss_graph import loss_ops, outputs_nonfinite

MAX_LOSS_CHECKS = 3  # bad steps whose loss function is examined: the first is the one that matters


class NanOrigin:
    def __init__(self):
        self.replayed: dict | None = None  # this step's replay (replay.py), if it ran
        self._loss_checks = 0

    def new_step(self) -> None:
        self.replayed = None

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

    def loss_check(self, step: int, loss, out_refs: list) -> list[dict]:
        """The loss_checks row of a bad step (the first MAX_LOSS_CHECKS), read now while the loss's
        graph and the model's outputs may still be alive; [] after those."""
        if self._loss_checks >= MAX_LOSS_CHECKS:
            return []
        self._loss_checks += 1
        return [{"step": step, "outputs_nonfinite": outputs_nonfinite(out_refs), "ops": json.dumps(loss_ops(loss))}]


def loss_is_bad(loss, loss_value: float) -> bool:
    return loss is not None and not math.isfinite(loss_value)
