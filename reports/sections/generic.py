"""Any other kind of finding: its summary stands for itself, and it has no figure."""

from __future__ import annotations

from ...analyzer.findings import Finding
from ..context import Context
from ..model import Figure, Text
from ._text import names, step, text

KIND = None


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    where = text(" in ", names(f.where)) if f.where else ()
    return text(f"{f.kind.replace('_', ' ')}", where, f" at {step(f.step)}" if f.step is not None else "")


def figure_for(ctx: Context, f: Finding) -> Figure | None:
    return None
