"""One global optimizer step pre-hook and one post-hook for every Recorder in the process.

torch iterates its global hook dicts while it calls them (``Optimizer.profile_hook_step``), so a
hook removed from inside one (a Recorder that fails in its optimizer hook unhooks itself, or a
second Recorder closes) raised "OrderedDict mutated during iteration" into the training loop.
Here torch's dicts get one hook each, registered once and never removed; Recorders subscribe to
and unsubscribe from our own lists, which a call iterates as a copy. Subscribers run in the
order they subscribed (trace_file/attempts.py subscribes at import: before any Recorder's black box).
"""

from __future__ import annotations

import itertools
from typing import Callable

_pre: dict[int, Callable] = {}
_post: dict[int, Callable] = {}
_ids = itertools.count()
_registered = False


class Handle:
    def __init__(self, table: dict, key: int):
        self._table, self._key = table, key

    def remove(self) -> None:
        self._table.pop(self._key, None)


def _run_pre(optimizer, args, kwargs) -> None:
    for fn in tuple(_pre.values()):
        fn(optimizer, args, kwargs)
    return None  # (never replaces the step's arguments)


def _run_post(optimizer, args, kwargs) -> None:
    for fn in tuple(_post.values()):
        fn(optimizer, args, kwargs)


def _subscribe(table: dict, fn: Callable) -> Handle:
    global _registered
    if not _registered:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(_run_pre)
        register_optimizer_step_post_hook(_run_post)
        _registered = True
    key = next(_ids)
    table[key] = fn
    return Handle(table, key)


def on_pre_step(fn: Callable) -> Handle:
    """fn(optimizer, args, kwargs) before every optimizer.step() of the process."""
    return _subscribe(_pre, fn)


def on_post_step(fn: Callable) -> Handle:
    """fn(optimizer, args, kwargs) after every optimizer.step() of the process."""
    return _subscribe(_post, fn)
