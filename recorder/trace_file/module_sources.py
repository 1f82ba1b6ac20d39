"""Where each module's code is: the file and line of its class and of its ``forward``, read once
when the Recorder starts, so that a finding about ``features.log`` can say "LogFeatures,
models/features.py:42" on a laptop that has no copy of the job's code. Kept as plain text.

A path is written relative to the ``sys.path`` entry it was imported from (the training script's
folder, site-packages), as the import would name it: ``models/features.py``,
``transformers/models/bert/modeling_bert.py``; else as it is. No file is read but the ones the
classes came from (through linecache, which the import already filled), one pass per class."""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys


def module_sources(modules: list) -> tuple[list[str], list[str]]:
    """(class source, forward source) of each module, "path:line" or "" where not known."""
    cache: dict[type, tuple[str, str]] = {}
    roots = _import_roots()
    out_class, out_forward = [], []
    for m in modules:
        cls = type(m)
        if cls not in cache:
            try:
                cache[cls] = _locate(cls, roots)
            except Exception:  # (a class made at run time, a frozen module, an odd loader)
                cache[cls] = ("", "")
        out_class.append(cache[cls][0])
        out_forward.append(cache[cls][1])
    return out_class, out_forward


def _import_roots() -> list[str]:
    roots = {os.path.abspath(p or os.getcwd()) for p in sys.path if isinstance(p, str)}
    return sorted(roots, key=len, reverse=True)  # the longest (most specific) first


def _short(path: str, roots: list[str]) -> str:
    path = os.path.abspath(path)
    for root in roots:
        if path.startswith(root + os.sep):
            return os.path.relpath(path, root).replace(os.sep, "/")
    return path


def _locate(cls: type, roots: list[str]) -> tuple[str, str]:
    forward = getattr(cls, "forward", None)
    try:  # (a decorated forward: the function it wraps, as functools.wraps says)
        forward = inspect.unwrap(forward) if forward is not None else None
    except ValueError:
        pass
    code = getattr(forward, "__code__", None)
    fwd = ""
    if code is not None and os.path.isfile(code.co_filename):
        fwd = f"{_short(code.co_filename, roots)}:{code.co_firstlineno}"
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return "", fwd
    lines = linecache.getlines(path)
    pattern = re.compile(rf"^\s*class\s+{re.escape(cls.__name__)}\b")
    hits = [i + 1 for i, text in enumerate(lines) if pattern.match(text)]
    if not hits:
        return "", fwd
    line = hits[0]
    if len(hits) > 1 and code is not None and code.co_filename == path:
        # (several classes of the name in one file: the last one before its forward)
        line = max((h for h in hits if h <= code.co_firstlineno), default=hits[0])
    return f"{_short(path, roots)}:{line}", fwd
