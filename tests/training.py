"""The plain training loop the tests record: a tiny model trained under the Recorder.

    train(model, run_dir, steps, batch, loss_fn, optimizer=opt, activations_every=1)

Each step: every group's lr set to lr_at(step), before_step, the batch, forward, loss,
zero_grad, backward, optimizer step, after_update, rec.step(loss=loss), after_step. It seeds
nothing: the caller seeds where its model and data need it. Loops that do more (a closure
step, accumulation, AMP, a subprocess job) keep their own.
"""

from __future__ import annotations

import contextlib

import torch

from torchautopsy import Recorder


def squared(out):
    """The mean square of the outputs: a loss for batches with no targets."""
    return out.pow(2).mean()


def squared_error(out, y):
    return ((out - y) ** 2).mean()


def train(model, run_dir, steps: int, batch, loss_fn=squared, optimizer=None, lr_at=None,
          before_step=None, after_update=None, after_step=None, pass_loss=True, hold_output=False,
          **recorder_options):
    """Train `model` for `steps` steps with the Recorder on `run_dir` (None: no recorder, the
    bare run to compare with) and return `run_dir`.

    batch: a function of the step, or the same batch every step; a batch is the model's input
    or a tuple (input, *rest), and the loss is loss_fn(model(input), *rest).
    optimizer: SGD at lr 0.01 when not given. lr_at(step): every group's learning rate for
    the step. before_step(step): first thing in a step (plant a fault, move the schedule).
    after_update(step, loss): after the optimizer step, before rec.step(). after_step(step,
    loss): last thing in a step (keep the loss as the loop saw it).
    pass_loss: whether rec.step() gets the loss (a bool, or a function of the step).
    hold_output: keep the model's output until the next step, as a loop that writes
    `out = model(x)` does (the recorder checks outputs still held when the loss goes bad);
    otherwise it is dropped once the loss is computed, as in `loss = loss_fn(model(x), y)`."""
    opt = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), lr=0.01)
    recording = Recorder(model, run_dir, **recorder_options) if run_dir is not None else contextlib.nullcontext()
    with recording as rec:
        for step in range(steps):
            if lr_at is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
            if before_step is not None:
                before_step(step)
            data = batch(step) if callable(batch) else batch
            x, *rest = data if isinstance(data, tuple) else (data,)
            out = model(x)
            loss = loss_fn(out, *rest)
            if not hold_output:
                out = None
            opt.zero_grad()
            loss.backward()
            opt.step()
            if after_update is not None:
                after_update(step, loss)
            if rec is not None:
                given = pass_loss(step) if callable(pass_loss) else pass_loss
                rec.step(loss=loss) if given else rec.step()
            if after_step is not None:
                after_step(step, loss)
    return run_dir
