"""train_eval_mode: training steps taken in eval mode, or evaluation run in train mode.

``model.eval()`` switches Dropout off and makes BatchNorm use (and stop updating) its running
statistics; ``model.train()`` switches them back. The debugging guides' classic: a validation
loop calls ``model.eval()`` and training resumes without ``model.train()``: the rest of the run
trains without dropout and with frozen BatchNorm statistics, silently. The reverse: evaluation
without ``model.eval()`` scores with dropout on, and every evaluation batch moves BatchNorm's
running statistics (so the evaluation changes the model).

The recorder reads the model's own mode at each forward pass (``steps/train_mode``: of the
forward passes that built a graph, 1 all in train mode, 0 all in eval mode, 2 both) and counts
forward passes without a graph run in train mode (``steps/nograd_train_forwards``). Only models
with Dropout or BatchNorm modules are judged: in the others the mode changes nothing.

- ``trained_in_eval`` (warning): the optimizer stepped on at least ``min_steps`` steps whose
  forward passes all ran in eval mode; dated at the first of the longest such run, and said to
  follow an evaluation when the steps before it trained in train mode.
- ``evaluated_in_train`` (warning): at least ``min_forwards`` forward passes without a graph
  ran in train mode (an evaluation loop under ``torch.no_grad()`` without ``model.eval()``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..display import listed
from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ._thresholds import check_bounds as _check

# The modules whose forward depends on the mode (torch.nn's; a model's own may also read
# self.training, which the trace cannot see).
MODE_TYPES = re.compile(r"Dropout|BatchNorm")


@dataclass(frozen=True)
class TrainEvalModeConfig:
    # Optimizer steps in eval mode in a row: one is a loop that evaluated between a forward and
    # its step; a forgotten model.train() leaves every step after the evaluation in eval mode.
    min_steps: int = 5
    # Forward passes without a graph in train mode: an evaluation loop runs many.
    min_forwards: int = 2

    def __post_init__(self):
        _check(self, min_steps=(1, None), min_forwards=(1, None))


class Evidence(BaseEvidence, total=False):
    cause: str  # trained_in_eval | evaluated_in_train
    mode_modules: list  # the Dropout and BatchNorm modules the mode changes (the first few)
    n_mode_modules: int
    eval_steps: int  # trained_in_eval: optimizer steps whose forward passes ran in eval mode
    first_eval_step: int  # ... the first step of the longest run of them
    last_eval_step: int  # ... and its last
    train_steps_before: int  # ... optimizer steps in train mode before it (0: from the start)
    nograd_train_forwards: int  # evaluated_in_train: forward passes without a graph in train mode
    first_nograd_step: int  # ... the step (rec.step() count) of the first


KIND = "train_eval_mode"
REQUIRES = ("steps/train_mode", "steps/optimizer_steps")
CONFIG = TrainEvalModeConfig
ORDER = 17

ADVICE = {
    "trained_in_eval": "Call model.train() before the training steps, in particular after each evaluation "
                       "(model.eval() stays on until model.train() is called): in eval mode Dropout is off and "
                       "BatchNorm neither uses the batch's statistics nor updates its running ones.",
    "evaluated_in_train": "Call model.eval() before evaluating (and model.train() after): in train mode Dropout "
                          "drops units of the evaluation's inputs and every evaluation batch moves BatchNorm's "
                          "running statistics. torch.no_grad() does not change the mode.",
}


def detect(rt: RankTrace, cfg: TrainEvalModeConfig) -> list[Finding]:
    modes = [n for n, t in zip(rt.module_names, rt.module_types) if MODE_TYPES.search(t)]
    if not modes:
        return []
    mode = rt.columns["train_mode"].to_numpy()
    stepped = rt.columns["optimizer_steps"].to_numpy() > 0
    steps = rt.step_index
    base = {"mode_modules": modes[:8], "n_mode_modules": len(modes)}
    findings = []
    in_eval = stepped & (mode == 0)
    opt_rows = np.flatnonzero(stepped)  # (a run of optimizer steps: micro-batch rows between them do not break it)
    a, b = _longest_run(mode[opt_rows] == 0)
    if b - a >= cfg.min_steps:
        start, last = int(opt_rows[a]), int(opt_rows[b - 1])
        before = int((stepped[:start] & (mode[:start] == 1)).sum())
        after_eval = before > 0
        ev: Evidence = {"cause": "trained_in_eval", **base, "eval_steps": int(in_eval.sum()),
                        "first_eval_step": int(steps[start]), "last_eval_step": int(steps[last]),
                        "train_steps_before": before}
        when = (f"from step {int(steps[start]):,} (after {before:,} steps in train mode: an evaluation's "
                "model.eval() was never undone)" if after_eval else "from the start")
        summary = (f"{int(in_eval.sum()):,} optimizer steps trained with the model in eval mode, {when}: "
                   f"{listed(modes, 3)} ran as in evaluation (no dropout, BatchNorm's running statistics used "
                   "and never updated).")
        findings.append(Finding(KIND, "warning", int(steps[start]), modes[:8], summary, ev,
                                ADVICE["trained_in_eval"]))
    nograd = rt.columns["nograd_train_forwards"].to_numpy()
    counted = np.where(nograd > 0, nograd, 0)
    if counted.sum() >= cfg.min_forwards:
        first = int(np.flatnonzero(counted)[0])
        ev = {"cause": "evaluated_in_train", **base, "nograd_train_forwards": int(counted.sum()),
              "first_nograd_step": int(steps[first])}
        summary = (f"{int(counted.sum()):,} forward passes without gradients (an evaluation under torch.no_grad()) "
                   f"ran with the model in train mode, from step {int(steps[first]):,}: {listed(modes, 3)} "
                   "dropped units and updated their running statistics during it.")
        findings.append(Finding(KIND, "warning", int(steps[first]), modes[:8], summary, ev,
                                ADVICE["evaluated_in_train"]))
    return findings


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, stop) of the longest run of True in ``mask``."""
    best, start = (0, 0), None
    for i, v in enumerate(np.append(mask, False)):
        if v and start is None:
            start = i
        elif not v and start is not None:
            if i - start > best[1] - best[0]:
                best = (start, i)
            start = None
    return best
