"""The detector registry. Every module of this package whose name does not start with "_" is a
detector, found here by itself, with:

- ``KIND``: the finding kind it reports (the README's table);
- ``CONFIG``: its thresholds, a frozen dataclass (a table of ``analyze --config``);
- ``REQUIRES``: the trace datasets it cannot work without (the runner reports a trace that lacks
  one as "not checked", run.py);
- ``ORDER``: its place among the detectors (findings of one step and stage list in this order);
- ``detect(rank_trace, cfg) -> list[Finding]``: a pure function over a read-only trace.

Adding a kind is adding a module here (with its test) and, for its own figure, one in
reports/sections/."""

from __future__ import annotations

import importlib
import pkgutil


def _discover() -> tuple:
    found = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
             if not m.name.startswith("_")]
    return tuple(sorted(found, key=lambda m: m.ORDER))


DETECTORS = _discover()
