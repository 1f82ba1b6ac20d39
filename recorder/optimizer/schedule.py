"""The optimizer's schedule, step by step: each param group's learning rate and the other
hyper-parameters, and AMP's loss scale with whether the GradScaler skipped the step.

An optimizer step post-hook (global: others' optimizers are ignored) counts the watched model's
optimizer steps of the iteration and keeps the hyper-parameters that step used: read at
rec.step() they would be the next step's, as a scheduler usually steps in between. A step the
GradScaler skipped runs no optimizer step at all: it is told by a count of 0 while the scaler's
scale fell.
"""

from __future__ import annotations

import math
import operator
import weakref

import torch

from ..memory.readings import live_instances

_PARAMS = operator.itemgetter("params")
# Group keys that are flags or bookkeeping, never a schedule (torch.optim's own names).
_NOT_HYPER = frozenset(("params", "initial_lr", "foreach", "fused", "capturable", "differentiable",
                        "maximize", "amsgrad", "nesterov", "decoupled_weight_decay", "name"))
NOT_RECORDED = -1  # optimizer_steps of a run whose optimizer was never seen (a hand-written update)


def _is_number(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return True
    return isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()


def _hyper_keys(group: dict) -> list[str]:
    """The numeric hyper-parameters of a param group (lr, momentum, betas, weight_decay, eps...)."""
    keys = []
    for k, v in group.items():
        if k in _NOT_HYPER or not isinstance(k, str):
            continue
        if _is_number(v) or (isinstance(v, tuple) and v and all(_is_number(x) for x in v)):
            keys.append(k)
    return keys


def _expand(keys: list[str], values: tuple) -> list[tuple[str, float]]:
    """(name, value) pairs: a tuple hyper-parameter (Adam's betas) gives betas.0, betas.1."""
    out = []
    for k, v in zip(keys, values):
        if isinstance(v, tuple):
            out.extend((f"{k}.{j}", _float(x)) for j, x in enumerate(v))
        else:
            out.append((k, _float(v)))
    return out


def _float(v) -> float:
    try:
        return float(v)  # a tensor lr (capturable optimizers) is read here: rare
    except (TypeError, ValueError, RuntimeError):
        return math.nan


def find_scaler_and_optimizers() -> tuple[list, list]:
    """The GradScalers and optimizers alive in this process, read through the garbage
    collector's object list (memory.readings.live_instances: no object's code runs). Done at
    the first step, and at most once more."""
    scaler_type = getattr(getattr(torch, "amp", None), "GradScaler", None)
    scalers, optimizers = [], []
    for o in live_instances(torch.optim.Optimizer, *([scaler_type] if scaler_type is not None else [])):
        (scalers if scaler_type is not None and issubclass(type(o), scaler_type) else optimizers).append(o)
    used = [s for s in scalers if getattr(s, "_enabled", False) and getattr(s, "_scale", None) is not None]
    return used, optimizers


class OptimizerSchedule:
    """Records the schedule of the optimizers of the watched model's parameters."""

    MAX_SCANS = 2  # looks for a GradScaler at the first step, and at the first skipped-looking step

    def __init__(self, param_ids: dict, scaler=None):
        self._param_ids = param_ids
        self.scaler = scaler
        self._scans = 0
        self._ended = 0  # steps ended so far
        self._candidates: list[tuple] = []  # several GradScalers alive: (weakref, scale's version)
        # id(optimizer) -> (weakref, (n groups, n params), whether it steps the model, its index)
        self._known: dict[int, tuple] = {}
        self._order: list = []  # weakrefs of the model's optimizers, in the order first seen
        self._keys: list[list[list[str]]] = []  # per optimizer, per group: its hyper-parameter keys
        self._tensors: list[bool] = []  # per optimizer: whether a hyper-parameter is a tensor
        self._last: list[list[tuple] | None] = []  # per optimizer: the values last written
        self._used: dict[int, list[tuple]] = {}  # this iteration's values, per optimizer index
        self._next: dict[int, list[tuple]] = {}  # the values as the last rec.step() left them
        self._new: list[dict] = []  # optimizers first seen this iteration (rows of optimizers/)
        # The model's parameters in an optimizer first seen, or whose groups changed, this
        # iteration (rows of optimizer_params/): which parameters it steps, and which of them
        # required gradients then (a frozen one in an optimizer never moves).
        self._members: list[dict] = []
        self.steps_now = 0  # the model's optimizer steps in this iteration
        self.skipped = False  # the last iteration: no optimizer step, and a GradScaler is in use
        self.last_steps = -1  # the last iteration's optimizer steps
        self._handle = None

    def attach(self) -> None:
        from .global_hooks import on_post_step
        ref = weakref.ref(self)

        def post_hook(optimizer, args, kwargs):
            s = ref()
            if s is not None:
                s._after_optimizer_step(optimizer)

        self._handle = on_post_step(post_hook)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _index(self, optimizer) -> int:
        """The optimizer's index among the model's, or -1 for an optimizer of other parameters."""
        groups = optimizer.param_groups
        key = (len(groups), sum(map(len, map(_PARAMS, groups))))
        hit = self._known.get(id(optimizer))
        if hit is None or hit[1] != key or hit[0]() is not optimizer:
            ours = any(id(p) in self._param_ids for g in groups for p in g["params"])
            k = -1
            if ours:
                k = next((j for j, r in enumerate(self._order) if r() is optimizer), -1)
                if k < 0:
                    self._order.append(weakref.ref(optimizer))
                    self._last.append(None)
                    k = len(self._order) - 1
                    self._new.append({"optimizer": k, "class": type(optimizer).__name__[:200]})
                self._members.extend({"optimizer": k, "param": i, "requires_grad": int(p.requires_grad)}
                                     for g in groups for p in g["params"]
                                     if (i := self._param_ids.get(id(p))) is not None)
                keys = [_hyper_keys(g) for g in groups]
                tensors = any(isinstance(g[x], torch.Tensor) for g, ks in zip(groups, keys) for x in ks)
                if k < len(self._keys):
                    self._keys[k], self._tensors[k] = keys, tensors
                else:
                    self._keys.append(keys)
                    self._tensors.append(tensors)
            hit = (weakref.ref(optimizer), key, k)
            self._known[id(optimizer)] = hit
        return hit[2]

    def _after_optimizer_step(self, optimizer) -> None:
        try:
            k = self._index(optimizer)
        except Exception:
            return  # an optimizer whose groups cannot be read is not ours to judge
        if k < 0:
            return
        self.steps_now += 1
        if k not in self._used:  # (accumulating code that steps twice: the first step's values)
            self._used[k] = self._values(optimizer, k)

    def _values(self, optimizer, k: int) -> list[tuple]:
        values = [tuple(map(g.get, keys)) for g, keys in zip(optimizer.param_groups, self._keys[k])]
        if self._tensors[k]:  # a tensor lr changes in place: keep its value, not the tensor
            values = [tuple(_float(v) if isinstance(v, torch.Tensor) else v for v in t) for t in values]
        return values

    def _scan(self, first: bool = False) -> None:
        """Find the GradScaler in use (when exactly one is) and the model's optimizers before
        they step: a scaler's skipped steps run no optimizer step for the hook to see."""
        if (self.scaler is not None and self._order) or self._scans >= self.MAX_SCANS:
            return
        self._scans += 1
        scalers, optimizers = find_scaler_and_optimizers()
        if self.scaler is None:
            # At the first step the scaler in use has updated its scale (in place) at most once;
            # one left by an earlier run in this process (not yet collected) has done so more.
            fresh = [s for s in scalers if s._scale._version <= 1] if first else []
            if len(fresh) == 1:
                self.scaler = fresh[0]
            else:  # told apart at the next steps (_pick_candidate)
                self._candidates = [(weakref.ref(s), s._scale._version) for s in scalers]
        for opt in optimizers:
            try:
                self._index(opt)
            except Exception:
                pass

    def _pick_candidate(self) -> None:
        """Of several GradScalers, the one in use is the one whose scale was updated (in place:
        its version counter moves at every scaler.update()) since the last step."""
        moved, alive = [], []
        for ref, version in self._candidates:
            s = ref()
            if s is None or getattr(s, "_scale", None) is None:
                continue
            alive.append((ref, s._scale._version))
            if s._scale._version != version:
                moved.append(s)
        self._candidates = alive
        if len(moved) == 1:
            self.scaler, self._candidates = moved[0], []

    def _scale(self) -> float:
        scaler = self.scaler
        if scaler is not None and scaler.is_enabled() and getattr(scaler, "_scale", None) is not None:
            return float(scaler.get_scale())  # (a host sync on CUDA: rec.step() has just made one)
        return math.nan

    def scaler_skipped(self) -> bool:
        """Whether the GradScaler skipped the step that just ended: no optimizer step ran while
        one is in use. Looks for a scaler once more the first time it is asked on such a step."""
        if not self.skipped and self.last_steps <= 0 and self.scaler is None:
            self._scan()
            self.skipped = self.scaler is not None and not math.isnan(self._scale())
        return self.skipped

    def end_step(self, step: int):
        """(lr, loss scale, optimizer steps, new rows of the hyperparams and optimizers tables or
        None) for the step now ending; resets the iteration."""
        if not self._ended:  # the first step recorded (a resumed run's is not step 0)
            self._scan(first=True)
        elif self._candidates:
            self._pick_candidate()
        scale = self._scale()
        n = self.steps_now if self._order else NOT_RECORDED
        self.last_steps = self.steps_now
        self.skipped = self.steps_now == 0 and not math.isnan(scale)
        rows = None
        used = self._used
        for k, ref in enumerate(self._order):
            values = used.get(k) or self._next.get(k)
            if values is None:  # not stepped this iteration (skipped): its values now
                opt = ref()
                if opt is None:
                    continue
                try:
                    values = self._values(opt, k)
                except Exception:
                    continue
            used[k] = values
            last = self._last[k]
            if values != last:  # only the groups that changed, and in them the values that did
                rows = rows if rows is not None else []
                for g, (keys, vals) in enumerate(zip(self._keys[k], values)):
                    if last is not None and g < len(last) and vals == last[g]:
                        continue
                    before = dict(_expand(keys, last[g])) if last is not None and g < len(last) else {}
                    rows.extend({"step": step, "optimizer": k, "group": g, "name": name, "value": v}
                                for name, v in _expand(keys, vals) if before.get(name) != v)
                self._last[k] = values
        lr = math.nan
        first = used.get(0)
        if first and "lr" in self._keys[0][0]:
            lr = _float(first[0][self._keys[0][0].index("lr")])
        tables = None
        if rows or self._new or self._members:
            tables = {"hyperparams": rows or [], "optimizers": [{**o, "first_step": step} for o in self._new],
                      "optimizer_params": [{"step": step, **m} for m in self._members]}
            self._new, self._members = [], []
        # Where steps may be skipped (a GradScaler), the values a skipped step would have used
        # are those before the scheduler's next step: read them now, at this rec.step().
        self._next = {}
        if self.scaler is not None:
            for k, ref in enumerate(self._order):
                opt = ref()
                if opt is not None:
                    try:
                        self._next[k] = self._values(opt, k)
                    except Exception:
                        pass
        self.steps_now = 0
        self._used = {}
        self._ended += 1
        return lr, scale, n, tables
