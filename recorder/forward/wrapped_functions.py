"""Observe calls of activation and attention functions made inside a model's forward.

Dead units and attention must be seen whether they come from a module (``nn.ReLU``,
``nn.MultiheadAttention``) or from a function called inside some module's ``forward``
(``F.relu``, ``F.scaled_dot_product_attention``). The only way to see the latter without user
help is to wrap those functions in their modules (``torch.nn.functional``, ``torch``) while a
recorder is active. Each wrapper calls the original function with exactly the arguments it was
given and returns its result untouched; only then does it show the result to the observers.
A call made by another wrapped function (``F.relu`` calls ``torch.relu``) is observed once, at
the outermost wrapper. Calls are observed only on the steps a recorder watches (every module
hooked, see module_watcher.py); on the other steps a wrapper only calls the original.

Also timed: ``__next__`` of DataLoader iterators (the training's wait for its next batch).

Not covered: tensor methods (``x.relu()``, ``x.tanh()``), and function objects captured before
the recorder started (``nn.TransformerEncoderLayer`` keeps the ``F.gelu`` it was built with;
its ``F.relu`` is still seen, through ``torch.relu``).

Under ``torch.compile`` the wrappers, like the module hooks (module_watcher.py), only call the original:
Dynamo traces whatever a compiled forward calls, and our observers (dicts of sites, ids,
weakrefs) are code it cannot trace (it failed on them: "Guard failed on the same frame it was
created"). ``compiling()`` is a constant to Dynamo, so the compiled graph is the one it would be
without the recorder, with no guard on our state and no graph break.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

# (namespace, attribute) -> how the call's activation is named in the trace
_ACTIVATIONS = (
    (F, "relu"), (F, "relu6"), (F, "leaky_relu"), (F, "gelu"), (F, "hardtanh"),
    (F, "tanh"), (F, "sigmoid"), (torch, "relu"), (torch, "tanh"), (torch, "sigmoid"),
)
# F.softmax: attention written out by hand (Hugging Face's eager attention: matmul, mask added,
# nn.functional.softmax, matmul), where the probabilities are the call's own output.
_ATTENTION = ((F, "scaled_dot_product_attention"), (F, "softmax"))

try:
    # True while Dynamo traces (a constant in the traced code); False in eager code.
    compiling = torch.compiler.is_compiling
except AttributeError:  # torch < 2.3
    try:
        from torch._dynamo import is_compiling as compiling
    except ImportError:
        def compiling() -> bool:
            return False


def eager(fn):
    """``fn`` run as plain Python when torch.compile'd code calls it (torch.compiler.disable).

    For the hooks of the model's root module: torch.compile(model) runs the root's hooks from
    nn.Module's own (untraced) call with Dynamo's frame callback set, so each hook would be a
    compiled frame of its own, in which nothing is measured and whose guards on our state (the
    black box's `armed`, a list's length) compile it again when the state changes. Run eagerly
    they measure the batch, time the forward and keep the inputs as without compile, and no
    guard is added. Inside a traced frame (the model called from a larger compiled function) a
    disabled hook is a graph break, never a different result. ~0.3 us a call."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return fn if disable is None else disable(fn)


@dataclass(eq=False)
class Observer:
    """What a recorder is shown: four callables (not the Recorder: it can be tested alone)."""

    on_activation: Callable  # (name, args, kwargs, out), on watched steps
    on_attention: Callable  # (name, args, kwargs, out), on watched steps
    on_data_wait: Callable  # (seconds in DataLoader.__next__)
    on_observer_error: Callable  # (the exception one of the above raised)


_state = threading.local()
_lock = threading.Lock()
_observers: list[Observer] = []
_originals: dict[tuple[int, str], object] = {}
# ids of the observers that watch the coming step (watching()). Calls are observed only on such
# steps; on the others (most of them) a wrapper goes straight to the original function.
_watching: set[int] = set()


def _wrap(namespace, attr: str, kind: str):
    original = getattr(namespace, attr)

    def wrapper(*args, **kwargs):
        # compiling() first: Dynamo must not read _watching (it would guard on it, and compile
        # again on every change). A step nobody watches: ~0.3 us instead of ~3 (measured).
        if compiling() or not _watching:
            return original(*args, **kwargs)
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        try:
            out = original(*args, **kwargs)
        finally:
            _state.depth = depth
        if depth == 0 and _observers:
            for obs in tuple(_observers):
                try:
                    if kind == "activation":
                        obs.on_activation(attr, args, kwargs, out)
                    else:
                        obs.on_attention(attr, args, kwargs, out)
                except Exception as e:  # an observer's fault never reaches the model
                    obs.on_observer_error(e)
        return out

    wrapper.__name__ = getattr(original, "__name__", attr)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original
    wrapper._torchautopsy_wrapper = True
    return original, wrapper


_loader_t0: float | None = None  # when the training thread entered DataLoader.__next__, while in it


def loader_since() -> float | None:
    """When the wait for the batch being loaded now began (perf_counter), or None: the heartbeat's
    "data" phase (distributed/heartbeat.py)."""
    return _loader_t0


def _wrap_next(original):
    """DataLoader iterators' __next__, timed: the training's wait for its next batch."""

    def __next__(self):
        if compiling():  # (a loader iterated inside compiled code: not timed)
            return original(self)
        global _loader_t0
        t0 = _loader_t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            _loader_t0 = None
            dt = time.perf_counter() - t0
            for obs in tuple(_observers):
                try:
                    obs.on_data_wait(dt)
                except Exception as e:
                    obs.on_observer_error(e)

    __next__._torchautopsy_wrapper = True
    __next__.__wrapped__ = original
    return __next__


def attach(observer) -> None:
    """Start showing calls to ``observer``; the first observer installs the wrappers."""
    with _lock:
        if not _observers:
            for ns, attr in _ACTIVATIONS:
                _install(ns, attr, "activation")
            for ns, attr in _ATTENTION:
                _install(ns, attr, "attention")
            it = _loader_iter()
            if it is not None and not getattr(it.__next__, "_torchautopsy_wrapper", False):
                _originals[(id(it), "__next__")] = it.__next__
                it.__next__ = _wrap_next(it.__next__)
        _observers.append(observer)


def _loader_iter():
    try:
        from torch.utils.data.dataloader import _BaseDataLoaderIter
    except ImportError:  # a torch without it: batches are not timed, nothing else changes
        return None
    return _BaseDataLoaderIter


def watching(observer, on: bool) -> None:
    """Whether ``observer`` wants the calls of the coming step (its activation and attention
    calls are observed on watched steps only)."""
    if on:
        _watching.add(id(observer))
    else:
        _watching.discard(id(observer))


def detach(observer) -> None:
    """Stop showing calls to ``observer``; the last one out restores the original functions."""
    with _lock:
        _watching.discard(id(observer))
        if observer in _observers:
            _observers.remove(observer)
        if not _observers:
            it = _loader_iter()
            for (ns_id, attr), original in list(_originals.items()):
                ns = F if ns_id == id(F) else it if it is not None and ns_id == id(it) else torch
                if getattr(getattr(ns, attr, None), "_torchautopsy_wrapper", False):
                    setattr(ns, attr, original)
            _originals.clear()


def _install(ns, attr: str, kind: str) -> None:
    if not hasattr(ns, attr) or getattr(getattr(ns, attr), "_torchautopsy_wrapper", False):
        return
    original, wrapper = _wrap(ns, attr, kind)
    _originals[(id(ns), attr)] = original
    setattr(ns, attr, wrapper)


def call_arg(args, kwargs, pos: int, name: str, default=None):
    """An argument of an observed call, passed by keyword or by position."""
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default
