"""A Hugging Face ``TrainerCallback`` for transformers' ``Trainer``.

    from torchautopsy.huggingface import TorchAutopsyCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TorchAutopsyCallback("runs/exp1")])

The Recorder watches the Trainer's model (``trainer.model``, names as its named_modules()
spells them); the black box keeps the keyword arguments of its forward calls (input_ids,
attention_mask, labels, ...), every micro-batch of the step.

Where. For each optimizer step the Trainer runs forward and backward per micro-batch, clips the
gradients, calls on_pre_optimizer_step, optimizer.step(), on_optimizer_step, steps the scheduler,
clears the gradients (model.zero_grad()) and only then calls on_step_end: a row written there
would have no gradients (and a NaN would show steps late). So rec.step() runs at
on_optimizer_step: after the update, this step's gradients still there. They are judged before
the update by the Recorder's global optimizer hook inside optimizer.step(), after the Trainer's
clipping, as in a plain loop (and under fp16 AMP only for a step the GradScaler does not skip):
on_pre_optimizer_step has nothing to add. One row per optimizer step, whatever
gradient_accumulation_steps is.

The loss. Callbacks are not given it, so a forward hook on the model takes the ``loss`` its
output holds (``outputs["loss"]``, or ``outputs[0]`` of a tuple when it is a single number), as
the Trainer's default compute_loss does, on training forward calls (grad enabled, model in
train mode), and combines the micro-batches of the step as the Trainer does before it logs the
loss: their mean, or their sum when the model was given ``num_items_in_batch`` (it normalised
its loss over the whole accumulated batch already; times the number of processes under
``average_tokens_across_devices``, as the Trainer scales it). With logging_steps=1 the Trainer
logs the same numbers (up to float rounding). Limits: a loss the model does not return is not
seen, so a ``compute_loss_func``, label smoothing (the Trainer takes the labels away from the
model) or a compute_loss override computing its own loss record no loss (NaN), or the model's
own if it still returns one; a compute_loss calling the model more than once per micro-batch
skews the mean; and the Trainer's ``logging_nan_inf_filter`` does not apply (a NaN loss is
recorded as NaN: that is the point).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from transformers import TrainerCallback

from ..config import RecorderConfig


def _loss_of(output):
    """The loss a model's output holds, as the Trainer's compute_loss reads it, or None."""
    if isinstance(output, Mapping):  # a ModelOutput is an OrderedDict
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        return None
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class TorchAutopsyCallback(TrainerCallback):
    """Records the training into ``run_dir/rank{N}.h5``: ``TorchAutopsyCallback(run_dir,
    **options)``, options as the Recorder's (see RecorderConfig). The Recorder is made when
    training begins (``self.recorder``) and closed when it ends."""

    def __init__(self, run_dir, **options):
        self.run_dir = os.fspath(run_dir)
        self.options = options
        # A misspelt option fails here, where the callback is made, not when training starts.
        RecorderConfig.from_kwargs(**{k: v for k, v in options.items() if k != "scaler"})
        self.recorder = None
        self._hook = None
        self._reset_loss()

    def _reset_loss(self) -> None:
        self._loss = None  # the sum of this step's micro-batch losses (on the device)
        self._n = 0
        self._normalised = False  # the model was given num_items_in_batch

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from ..recorder import Recorder

        self._close()  # a second train() with the same callback starts a new trace
        # A run resumed from a checkpoint numbers its steps on from the Trainer's step.
        self.recorder = Recorder(model, self.run_dir, **{"start_step": state.global_step, **self.options})
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self._reset_loss()

    def _on_forward(self, module, args, kwargs, output):
        if not (module.training and torch.is_grad_enabled()):
            return None  # evaluation, generation
        try:  # never raise into the model's forward
            loss = _loss_of(output)
            if loss is not None:
                loss = loss.detach().reshape(())
                self._loss = loss if self._loss is None else self._loss + loss
                self._n += 1
                self._normalised = kwargs.get("num_items_in_batch") is not None
        except Exception:
            pass
        return None

    def on_optimizer_step(self, args, state, control, **kwargs):
        rec = self.recorder
        if rec is None:
            return
        loss = self._loss
        if loss is not None and not self._normalised and self._n > 1:
            loss = loss / self._n
        elif loss is not None and self._normalised and getattr(args, "average_tokens_across_devices", False) \
                and args.world_size > 1:
            loss = loss * args.world_size  # Trainer.compute_loss scales it so
        self._reset_loss()
        rec.step(loss=loss)

    def on_train_end(self, args, state, control, **kwargs):
        self._close()

    def _close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.close()
