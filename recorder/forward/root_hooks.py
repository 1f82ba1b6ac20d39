"""The root module's two hooks, on every step (plain ones too): one pair serves the probes that
watch the whole forward, so that a plain step pays two hook calls, not two per probe.

- the forward's start and end: StepClock (step_time.py);
- the model's mode at each forward: TrainMode (below);
- the batch's statistics, on training forwards: InputStats (input_stats.py), a probe;
- the outputs of the last training forward, for a loss gone NaN (NanOrigin, blackbox/loss_graph.py).

StepClock and TrainMode are read once a step into the steps/ row (step_rows.py: split, take) and
need nothing of the probe protocol.

They run eagerly under torch.compile (wrapped_functions.eager; see module_watcher.py)."""

from __future__ import annotations

import torch

from ..profiler.profile_windows import own_work
from .wrapped_functions import eager

_MODE = (-1, 1, 0, 2)  # mode bits -> steps/train_mode: none, train, eval, both


class TrainMode:
    """The model's mode at its forward passes since the last rec.step(): bit 1 a pass with
    gradients in train mode, bit 2 one in eval mode; and passes without gradients in train mode
    (an evaluation that forgot model.eval())."""

    def __init__(self):
        self._bits = 0
        self._nograd_train = 0

    def on_forward(self, training: bool, grad: bool) -> None:
        if grad:
            self._bits |= 1 if training else 2
        elif training:
            self._nograd_train += 1

    def take(self) -> tuple[int, int]:
        """(steps/train_mode, steps/nograd_train_forwards) of the step; counts the next one."""
        out = _MODE[self._bits], self._nograd_train
        self._bits = self._nograd_train = 0
        return out


class RootHooks:
    def __init__(self, root: torch.nn.Module, clock, mode: TrainMode, inputs, origin, on_error):
        self._clock, self._mode, self._inputs, self._origin = clock, mode, inputs, origin
        self._on_error = on_error
        self._handles = [root.register_forward_pre_hook(eager(self._pre_hook), with_kwargs=True),
                         root.register_forward_hook(eager(self._hook))]

    def _pre_hook(self, module, args, kwargs):
        self._clock.on_forward_start()
        if torch.is_grad_enabled():  # a training forward: its batch's statistics
            try:
                with own_work():
                    self._inputs.on_forward(args, kwargs)
            except Exception as e:  # never into the training's forward
                self._on_error(e)
        return None

    def _hook(self, module, args, output):
        self._clock.on_forward_end()
        grad = torch.is_grad_enabled()
        self._mode.on_forward(module.training, grad)
        if grad:  # a training forward: its outputs, for a loss gone NaN (blackbox/loss_graph.py)
            try:
                with own_work():
                    self._origin.on_training_output(output)
            except Exception as e:  # never into the training's forward
                self._origin.forget_outputs()
                self._on_error(e)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
