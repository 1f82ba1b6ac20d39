"""One module per finding kind: ``phrase(findings)`` says in a few words what went wrong (the
verdict chains these), ``figure_for(ctx, finding)`` draws the evidence. Every module here whose
name does not start with "_" is found by itself, by its ``KIND``; kinds with no module
(analyzer_error, unreadable_rank, kinds without a figure of their own) fall back to ``generic``."""

from __future__ import annotations

import importlib
import pkgutil

from . import generic


def _discover() -> dict:
    mods = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
            if not m.name.startswith("_") and m.name != "generic"]
    return {m.KIND: m for m in mods}


SECTIONS = _discover()


def section(kind: str):
    return SECTIONS.get(kind, generic)
