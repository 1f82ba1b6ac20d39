"""Lightning callbacks, for ``lightning`` (lightning.pytorch) and ``pytorch_lightning``.

    from torchautopsy.lightning import TorchAutopsyCallback        # or torchautopsy.pytorch_lightning
    trainer = Trainer(callbacks=[TorchAutopsyCallback("runs/exp1")])

Each Trainer accepts only instances of its own package's Callback class: one body (_Glue) is
mixed into each, the class made (and its package imported) when first asked for.

The Recorder watches the LightningModule itself (names as its named_modules() spells them). The
black box keeps each step's batch (and the inputs of the module's own forward calls); a NaN born
on a step that was not watched is found by running ``training_step`` again on that batch, on a
copy of the module, as Lightning ran it: a training_step that calls a child (``self.model(x)``)
rather than ``self(x)`` is replayed too (manual optimization is not: its training_step steps
the optimizers).

Where the gradients are judged. Without a GradScaler, Lightning calls ``optimizer.step(closure)``
and the closure runs training_step and backward *inside* the step, after the Recorder's global
optimizer hook, which skips such a step (it would see the last step's gradients).
on_before_optimizer_step runs after the closure's backward, before the update (and before
Lightning clips the gradients): it calls Recorder.before_optimizer_step(), so the black box gets
the inputs, gradients, optimizer state and parameters before the update, as in a plain loop.
With a GradScaler (precision="16-mixed" on a GPU) the closure runs first and the scaler calls
optimizer.step() without a closure, and only when the gradients are finite: the global hook
judges that step, as in a plain loop, and an overflow the scaler skips does not fire the box.

One row per training batch that stepped an optimizer (every k-th batch with
accumulate_grad_batches=k), written at on_train_batch_end: after the update, before the next
zero_grad. Its loss is training_step's as Lightning hands it on (``outputs["loss"]``, detached):
with automatic optimization, divided by accumulate_grad_batches by Lightning and summed here
over the batches of the step, which gives their mean loss (what Lightning backpropagated); with
manual optimization, the mean of what training_step returned over those batches.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

import torch

from ..config import RecorderConfig

# Class name in this module -> (the framework's package, the public module it is exposed by).
_FRAMEWORKS = {
    "LightningCallback": ("lightning.pytorch", "torchautopsy.lightning"),
    "PytorchLightningCallback": ("pytorch_lightning", "torchautopsy.pytorch_lightning"),
}


class _Glue:
    """Records the training into ``run_dir/rank{N}.h5``: ``TorchAutopsyCallback(run_dir,
    **options)``, options as the Recorder's (see RecorderConfig). The Recorder is made when
    training starts (``self.recorder``), and closed when it ends or raises."""

    def __init__(self, run_dir, **options):
        super().__init__()
        self.run_dir = os.fspath(run_dir)
        self.options = options
        # A misspelt option fails here, where the callback is made, not when training starts.
        RecorderConfig.from_kwargs(**{k: v for k, v in options.items() if k != "scaler"})
        self.recorder = None
        self._judge = True  # the optimizer steps with a closure: judge its gradients here
        self._stepped = False  # an optimizer stepped since the last row
        self._losses: list[torch.Tensor] = []  # the batches' losses since the last row

    def on_train_start(self, trainer, pl_module) -> None:
        from ..recorder import Recorder

        self._close()  # a second fit() with the same callback starts a new trace
        # A fit resumed from a checkpoint (ckpt_path=) numbers its steps on from the trainer's.
        self.recorder = Recorder(pl_module, self.run_dir, **{"start_step": trainer.global_step, **self.options})
        self._judge = getattr(trainer.precision_plugin, "scaler", None) is None
        self._stepped, self._losses = False, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The black box keeps the batch, and its replay runs training_step on it (a copy of the
        # module, without the Trainer: its self.log() is skipped), as Lightning ran the step, so
        # a training_step calling a child (self.model(x)) rather than self(x) is replayed too.
        # Manual optimization's training_step steps the optimizers itself: not replayed.
        if self.recorder is not None and pl_module.automatic_optimization:
            self.recorder.keep_step_call("training_step", (batch, batch_idx), shared={id(trainer): None})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepped = True
        if self.recorder is not None and self._judge:
            # The torch optimizer, not its LightningOptimizer wrapper (another object).
            self.recorder.before_optimizer_step(getattr(optimizer, "_optimizer", optimizer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.recorder is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())
        if not self._stepped:
            return  # accumulating gradients: no optimizer step yet
        losses, self._losses, self._stepped = self._losses, [], False
        if len(losses) > 1:
            total = torch.stack([x.reshape(()) for x in losses]).sum()
            loss = total if pl_module.automatic_optimization else total / len(losses)
        else:
            loss = losses[0] if losses else None
        self.recorder.step(loss=loss)

    def on_train_end(self, trainer, pl_module) -> None:
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        rec, self.recorder = self.recorder, None
        if rec is not None:  # as `with Recorder(...)` would: the black box, an OOM's census
            rec.__exit__(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer, pl_module, stage) -> None:
        self._close()

    def _close(self) -> None:
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.close()


def _make(name: str) -> type:
    package, public = _FRAMEWORKS[name]
    base = importlib.import_module(package).Callback
    cls = type("TorchAutopsyCallback", (_Glue, base), {"__doc__": _Glue.__doc__, "__module__": public})
    globals()[name] = cls  # made once
    return cls


def __getattr__(name: str):
    if name in _FRAMEWORKS:
        return _make(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
