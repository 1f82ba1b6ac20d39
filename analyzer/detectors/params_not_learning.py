"""params_not_learning: parameters that never change while the optimizer steps, each by its cause.

The debugging guides' first check ("are all the parameters being trained?"), from the trace: over
the steps on which the model's optimizer stepped (steps/optimizer_steps > 0), a parameter is

- ``not_in_optimizer`` (error): it requires gradients and gets them, but no optimizer of the
  model steps it (``optimizer_params/``), and its weight norm never moved. A head or adapter
  added after the optimizer was made, a second module list the optimizer was not given.
- ``unused`` (warning): in an optimizer, requiring gradients, never given one, and its module
  never ran on a watched step: defined in ``__init__``, not called in ``forward``.
- ``detached`` (warning): the same, but its module ran: its output reaches the loss only
  through ``.detach()``, ``.data``, ``torch.no_grad()`` or a NumPy round trip, or not at all
  (an auxiliary output whose loss was never added).
- ``not_used`` (info): the same, but the module's other parameters get gradients: its output
  reaches the loss, the forward does not use this one (a ViT's or DINOv2's mask_token, used only
  for masked inputs; a branch not taken).
- ``zero_gradient`` (warning): given a gradient on every step, exactly 0 every time (a mask or a
  factor that is always 0, every unit after it dead).
- ``frozen_in_optimizer``: handed to an optimizer with ``requires_grad=False``, never given a
  gradient. A frozen backbone handed to the optimizer whole is common and harmless (info); an
  error when every parameter the optimizers step is frozen (nothing learns), a warning when a
  frozen parameter comes after trained ones in the model's order (not a backbone: a layer frozen
  by a name pattern that matched too much, a head left frozen).

Each cause needs ``min_steps`` optimizer steps: a branch a model skips on some steps (a mixture
of experts' unrouted expert, a conditional layer) gets gradients on others. The step of a
finding is the first step the optimizer stepped: the first the parameters could have learned at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..display import listed
from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ._thresholds import check_bounds as _check


@dataclass(frozen=True)
class ParamsNotLearningConfig:
    # Optimizer steps a parameter must have gone without learning: a parameter used in the forward
    # gets a gradient on every step; a routed or conditional branch gets some within a few steps.
    min_steps: int = 10

    def __post_init__(self):
        _check(self, min_steps=(1, None))


class Evidence(BaseEvidence, total=False):
    cause: str  # not_in_optimizer | unused | detached | not_used | zero_gradient | frozen_in_optimizer
    params: list  # every parameter of the cause (where: the first few)
    n_params: int  # how many
    n_elements: int  # their elements
    optimizer_steps: int  # steps on which the model's optimizer stepped
    steps_with_gradient: int  # not_in_optimizer: steps on which they had a gradient
    weight_norm_moved: bool  # not_in_optimizer: whether their norms changed on the measured steps (no)
    module_ran: bool  # unused/detached/not_used: whether their modules ran on a watched step
    trained_params: int  # frozen_in_optimizer: the optimizers' parameters that were not frozen
    first_trained_before: str  # frozen_in_optimizer: a trained parameter the frozen ones come after


KIND = "params_not_learning"
REQUIRES = ("params/grad_norm", "steps/optimizer_steps")
CONFIG = ParamsNotLearningConfig
ORDER = 15

ADVICE = {
    "not_in_optimizer": "Create the optimizer after the model is complete (after replacing its head or adding "
                        "adapters), or add these with optimizer.add_param_group({'params': [...]}). "
                        "Check that the optimizer gets model.parameters() of the model that is trained.",
    "unused": "These modules are defined but never called in forward: call them, or delete them (under DDP an "
              "unused parameter also needs find_unused_parameters=True, which costs every step).",
    "detached": "These modules run, but no gradient comes back to them: look in the forward for .detach(), .data, "
                "torch.no_grad(), .item() or .numpy() on their outputs, or an output whose loss term was never "
                "added to the loss.",
    "not_used": "Their modules run and learn, but the forward never uses these parameters on the steps recorded: "
                "if they belong to a branch this training never takes (a mask token, a second head), nothing is "
                "wrong; otherwise check the condition that skips them.",
    "zero_gradient": "Their gradient is exactly 0 on every step: look for a mask or factor that is always 0 after "
                     "them, or units after them that never activate (dead ReLUs).",
    "frozen_in_optimizer": "These have requires_grad=False and never change. If that was meant (a frozen backbone), "
                           "pass only the trained ones to the optimizer: [p for p in model.parameters() if "
                           "p.requires_grad]. If not, check the pattern that froze them.",
}
SEVERITY = {"not_in_optimizer": "error", "unused": "warning", "detached": "warning", "not_used": "info",
            "zero_gradient": "warning"}


def detect(rt: RankTrace, cfg: ParamsNotLearningConfig) -> list[Finding]:
    stepped = rt.columns["optimizer_steps"].to_numpy() > 0
    n_opt = int(stepped.sum())
    n = len(rt.param_names)
    if n_opt < cfg.min_steps or n == 0:
        return []
    d = rt.digest  # (its one pass over the parameter tables counts each one's gradients)
    with_grad, zero = np.asarray(d.grad_steps), np.asarray(d.grad_zero_steps)
    if len(with_grad) != n:
        return []
    members = rt.optimizer_params
    in_opt = np.zeros(n, bool)
    frozen_then = np.zeros(n, bool)
    if len(members):
        in_opt[members["param"].to_numpy()] = True
        frozen_then[members["param"].to_numpy()[members["requires_grad"].to_numpy() == 0]] = True
    static = rt.param_requires_grad
    requires = np.where(in_opt, ~frozen_then, static == 1)
    never = with_grad == 0
    groups: dict[str, np.ndarray] = {}
    if len(members):
        moved = np.asarray(d.norm_max) > np.asarray(d.norm_min)
        groups["not_in_optimizer"] = requires & ~in_opt & (with_grad > 0) & ~moved
        lost = requires & in_opt & never
        ran = _modules_ran(rt) if lost.any() else {}  # (a pass over the module table, only then)
        index = {name: i for i, name in enumerate(rt.module_names)}
        ran_p = [ran.get(index.get(name.rpartition(".")[0])) for name in rt.param_names]  # (None: not known)
        groups["unused"] = lost & np.array([r is False for r in ran_p])
        detached = lost & np.array([r is True for r in ran_p])
        # A parameter whose module's other parameters learn: the module's output reaches the loss,
        # the forward did not use this one (a branch not taken: a ViT's mask_token, used only
        # for masked inputs). Its own cause, an info: most such are meant.
        owner = [name.rpartition(".")[0] for name in rt.param_names]
        learning = {owner[i] for i in np.flatnonzero(with_grad > 0)}
        groups["not_used"] = detached & np.array([o in learning for o in owner])
        groups["detached"] = detached & ~groups["not_used"]
    groups["zero_gradient"] = (with_grad >= n_opt) & (zero == with_grad)
    first = int(rt.step_index[np.flatnonzero(stepped)[0]])  # the first step they could have learned at
    findings = [_finding(rt, cause, np.flatnonzero(mask), n_opt, with_grad, first)
                for cause, mask in groups.items() if mask.any()]
    frozen = np.flatnonzero(in_opt & frozen_then & never)
    if frozen.size:
        findings.append(_frozen(rt, frozen, np.flatnonzero(in_opt & ~frozen_then), n_opt, first))
    return findings


def _finding(rt, cause: str, idx: np.ndarray, n_opt: int, with_grad: np.ndarray, first: int) -> Finding:
    names = [rt.param_names[i] for i in idx]
    ev = _common(rt, cause, idx, n_opt)
    what = {"not_in_optimizer": "are in no optimizer: they get gradients and never change",
            "unused": "never get a gradient: their modules never run in forward",
            "detached": "never get a gradient, though their modules run: their outputs do not reach the loss",
            "not_used": "never get a gradient while the other parameters of their modules do: the forward does "
                        "not use them (a branch not taken, such as a mask token for masked inputs)",
            "zero_gradient": "get a gradient of exactly 0 on every step"}[cause]
    if cause == "not_in_optimizer":
        ev["steps_with_gradient"] = int(with_grad[idx].max())
        ev["weight_norm_moved"] = False
    if cause in ("unused", "detached", "not_used"):
        ev["module_ran"] = cause != "unused"
    summary = f"{_count(names)} {what} ({n_opt:,} optimizer steps): {listed(names, 4)}."
    return Finding(KIND, SEVERITY[cause], first, names[:8], summary, ev, ADVICE[cause])


def _frozen(rt, frozen: np.ndarray, trained: np.ndarray, n_opt: int, first: int) -> Finding:
    names = [rt.param_names[i] for i in frozen]
    ev = _common(rt, "frozen_in_optimizer", frozen, n_opt)
    ev["trained_params"] = int(trained.size)
    if not trained.size:
        severity, why = "error", "every parameter the optimizer steps is frozen: nothing learns"
    elif frozen.max() > trained.min():
        severity, why = "warning", (f"frozen among trained ones (after {rt.param_names[trained.min()]}): "
                                    "not a frozen backbone")
        ev["first_trained_before"] = rt.param_names[int(trained.min())]
    else:
        severity, why = "info", "a frozen backbone before the trained parameters"
    summary = (f"{_count(names)} handed to the optimizer with requires_grad=False never change ({why}): "
               f"{listed(names, 4)}.")
    return Finding(KIND, severity, first, names[:8], summary, ev, ADVICE["frozen_in_optimizer"])


def _common(rt, cause: str, idx: np.ndarray, n_opt: int) -> dict:
    return {"cause": cause, "params": [rt.param_names[i] for i in idx[:200]], "n_params": int(idx.size),
            "n_elements": int(rt.param_numel[idx].sum()), "optimizer_steps": n_opt}


def _count(names: list[str]) -> str:
    return "1 parameter" if len(names) == 1 else f"{len(names):,} parameters"



def _modules_ran(rt) -> dict[int, bool]:
    """Per module index: whether it ran on some watched step (its output measured); modules no
    watched step could have seen (none watched) are left out."""
    ran = np.zeros(len(rt.module_names), bool)
    watched = False
    for _, block in rt.blocks("modules/output_absmax"):
        rows = block[block[:, 0] != -1] if block.shape[1] else block[:0]
        if len(rows):
            watched = True
            ran |= (rows != -1).any(axis=0)
    return {i: bool(r) for i, r in enumerate(ran)} if watched else {}

