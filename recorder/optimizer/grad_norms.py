"""The gradient norms of every step, taken in an optimizer step pre-hook (global_hooks.py):
after the backward, before the update. There one host sync gives each parameter's gradient norm,
which rec.step() reuses on plain steps (if the gradients were not replaced or written since), and
a NaN/Inf among them is seen while the parameters are still those the bad step started from (the
black box fires then: recorder.before_optimizer_step)."""

from __future__ import annotations

import itertools
import math
import operator
import weakref

import numpy as np
import torch

from ..probe import Probe, StepPlan
from ..reductions.fused import fused_here
from ..reductions.stats import Packer, l2_norm_values, max_and_absmax, takes_dots

# Per-parameter reads done by map() in C: right after a training step each line of Python runs
# cold, and a generator over the parameters costs several us more than these (measured).
_VERSION = operator.attrgetter("_version")
_PARAMS = operator.itemgetter("params")


class GradientNorms(Probe):
    def __init__(self, params: list, param_index: dict[int, int], grad_of, fused: bool | None = None):
        self._params = params
        # a parameter's gradient (its local shard under FSDP2: distributed/sharding.py)
        self._grad_of = grad_of
        self._param_index = param_index  # id(parameter) -> its index
        self._all_index = list(range(len(params)))  # the indices of an optimizer of them all
        # This step's norms, one entry per optimizer step: (param indices, gradients, their
        # versions, norms, all finite).
        self.entries: list[tuple[list[int], list, list[int], list[float], bool]] = []
        # id(optimizer) -> (weakref to it, (groups, params), param indices, params, dots)
        self._opt_params: dict[int, tuple] = {}
        self._handled_at: dict[int, tuple] = {}  # id(optimizer) -> (step, its entry in entries)
        self.saw_optimizer = False  # an optimizer step of the model's parameters was seen
        self.fused_option = fused  # (RecorderConfig.fused_reductions: one transfer, as on a GPU)
        # Whether this step's optimizer steps used the very gradient tensors their previous steps
        # used (1), never set to None in between: a loop without zero_grad() (or one that zeroes
        # them in place); 0: new ones; -1: no optimizer step judged. One weakref per optimizer.
        self.kept = -1
        self._last_grad: dict[int, weakref.ref] = {}  # id(optimizer) -> its first gradient, last step

    def arm(self, plan: StepPlan) -> None:
        """The coming step's optimizer steps are judged afresh."""
        self.entries = []
        self.kept = -1

    def judge(self, optimizer, step: int) -> list[int] | None:
        """Take the norms of the gradients of ``optimizer``'s parameters of the model (one host
        sync); the indices of those holding NaN/Inf (an empty list: all finite), or None if it
        is no optimizer of the model, they have no gradients yet, or they were judged already
        this step and not changed since."""
        index, params, dots = self._optimized(optimizer)
        if not params:
            return None  # not an optimizer of the watched model
        grads = list(map(self._grad_of, params))
        seen = self._handled_at.get(id(optimizer))
        if seen is None or seen[0] != step:  # (once per optimizer and step: a closure judges again)
            self._note_kept(optimizer, grads)
        if seen is not None and seen[0] == step and seen[1] < len(self.entries):
            # Judged already this step: nothing new to see unless the gradients changed
            # since (other tensors, or written in place: a closure's backward run again).
            _, judged, versions = self.entries[seen[1]][:3]
            kept = [g for g in grads if g is not None and not g.is_sparse]
            if (len(kept) == len(judged) and all(map(operator.is_, kept, judged))
                    and list(map(_VERSION, kept)) == versions):
                return None
        # No no_grad() (~15 us): gradients made with backward(create_graph=True) give a norm
        # that records a graph node, dropped with it at once. Each check of the gradients is a
        # pass over them, a few us cold: the common case (every one dense) is tried first, on
        # the path chosen for the optimizer's parameters.
        one = True if self.fused_option else None  # (fused: the GPU's one transfer, anywhere)
        try:
            values = l2_norm_values(grads, dots, one)
        except (AttributeError, TypeError, RuntimeError):  # frozen (None) or sparse ones: left out
            kept = [k for k, g in enumerate(grads) if g is not None and not g.is_sparse]
            index, grads = [index[k] for k in kept], [grads[k] for k in kept]
            values = l2_norm_values(grads, None, one)
        if not grads:
            return None  # no gradients (yet)
        self.saw_optimizer = True
        # (plain Python: right after a training step a numpy call costs ~50 us, measured;
        # norms are >= 0 and below ~2e19, so their sum is finite exactly when each is)
        finite = math.isfinite(sum(values))
        self.entries.append((index, grads, list(map(_VERSION, grads)), values, finite))
        self._handled_at[id(optimizer)] = (step, len(self.entries) - 1)
        if finite:
            return []
        with torch.no_grad():
            # Rare from here on. A finite gradient whose float32 norm overflowed is not a
            # failure: each gradient is checked.
            return [i for i, g in zip(index, grads) if not bool(torch.isfinite(g).all())]

    def _note_kept(self, optimizer, grads: list) -> None:
        first = next((g for g in grads if g is not None), None)
        if first is None:
            return
        last = self._last_grad.get(id(optimizer))
        if last is not None and last() is first:
            self.kept = 1
        elif self.kept < 0 and (last is None or last() is not first):
            self.kept = 0
        if last is None or last() is not first:
            try:
                self._last_grad[id(optimizer)] = weakref.ref(first)
            except TypeError:  # (a tensor subclass without weak references: not known)
                self._last_grad.pop(id(optimizer), None)

    def _optimized(self, optimizer) -> tuple[list[int], list[torch.Tensor], bool]:
        """(indices, parameters, whether their gradients' norms take dots: stats.takes_dots) of
        the watched model's parameters in an optimizer's groups; found once per optimizer and
        again when its groups change. An optimizer of every parameter, in the model's order,
        gets self._all_index itself (see cached).
        Kept by id(), the optimizer checked through a weak reference: a WeakKeyDictionary's
        lookup (a weakref made in Python per call) cost ~15 us a step, cold (measured)."""
        groups = optimizer.param_groups
        key = (len(groups), sum(map(len, map(_PARAMS, groups))))
        hit = self._opt_params.get(id(optimizer))
        if hit is None or hit[1] != key or hit[0]() is not optimizer:
            pairs = [(i, p) for g in groups for p in g["params"] if (i := self._param_index.get(id(p))) is not None]
            index = [i for i, _ in pairs]
            params = [p for _, p in pairs]
            hit = (weakref.ref(optimizer), key, self._all_index if index == self._all_index else index,
                   params, takes_dots(params))  # (a gradient has its parameter's size, dtype, device)
            self._opt_params[id(optimizer)] = hit
        return hit[2], hit[3], hit[4]

    def _applied(self, n: int) -> list[float] | None:
        """The norms the optimizer steps of this step judged (NaN for parameters none did), or
        None if one was NaN/Inf."""
        norms = [math.nan] * n
        for index, _, _, values, finite in self.entries:
            if not finite:
                return None
            for i, v in zip(index, values):
                norms[i] = v
        return norms

    def cached(self) -> list[float] | None:
        """The norm of each parameter's gradient as the optimizer step pre-hook computed it this
        step (NaN for a parameter without a gradient), or None if a gradient was not seen there
        (another optimizer, none), has been replaced or changed in place since, or one is NaN or
        Inf (a bad step: measured in full). Gradients all set to None since (a loop that calls
        zero_grad() before rec.step()) keep the norms the update used."""
        entries = self.entries
        if not entries:
            return None
        now = list(map(self._grad_of, self._params))
        if all(map(operator.is_, now, itertools.repeat(None))):
            return self._applied(len(now))
        if len(entries) == 1 and entries[0][0] is self._all_index:  # one optimizer of them all: most jobs
            _, grads, versions, values, finite = entries[0]
            ok = finite and all(map(operator.is_, now, grads)) and list(map(_VERSION, grads)) == versions
            return values if ok else None
        norms, seen = [math.nan] * len(now), [False] * len(now)
        for index, grads, versions, values, finite in entries:
            if not finite:
                return None
            if list(map(_VERSION, grads)) != versions:
                return None
            for i, g, v in zip(index, grads, values):
                if now[i] is not g:
                    return None
                norms[i], seen[i] = v, True
        if any(g is not None and not s and not g.is_sparse for g, s in zip(now, seen)):
            return None
        return norms


def exact_overflowed_norms(norms: np.ndarray, absmax, tensors) -> np.ndarray:
    """Recompute in float64 the float32 norms that overflowed to Inf while every element was finite.

    Rare (elements above ~1e19): costs a second transfer on that step only.
    """
    if np.isfinite(norms).all():
        return norms
    over = [j for j in range(len(norms)) if np.isinf(norms[j]) and (absmax is None or np.isfinite(absmax[j]))]
    if not over:
        return norms
    exact = torch.stack([torch.linalg.vector_norm(tensors[j], 2, dtype=torch.float64) for j in over])
    norms = norms.copy()
    norms[over] = exact.cpu().numpy()
    return norms


def add_grad_absmax(pk: Packer, grads: list, fused: bool | None) -> None:
    """max |g| of each gradient (and whether it holds NaN/Inf: NaN or Inf then): one
    _foreach_norm(ord=inf) fused (a GPU), an aminmax per tensor otherwise, as ord inf is ~16x
    slower than aminmax on the CPU (measured). ``fused``: None decides by the device."""
    if fused_here(fused, grads[0]):
        pk.add("grad_absmax", torch._foreach_norm(grads, math.inf))
        return
    # (an empty tensor -- an FSDP2 shard of a parameter smaller than the ranks -- has no extrema:
    # its max |g| is 0)
    mm = [torch.aminmax(g) if g.numel() else (g.new_zeros(()), g.new_zeros(())) for g in grads]
    pk.add("grad_absmax", max_and_absmax([m[0] for m in mm], [m[1] for m in mm])[1])
