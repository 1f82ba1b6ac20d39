"""Running text with names in it, for the verdict: ``text("gradients of ", name(w), " exploded")``."""

from __future__ import annotations

from ..model import Span, Text


def text(*parts: str | Span | Text) -> Text:
    out: list[Span] = []
    for p in parts:
        if isinstance(p, Span):
            out.append(p)
        elif isinstance(p, tuple):
            out.extend(p)
        elif p:
            out.append(Span(p))
    return tuple(out)


def name(n: str) -> Span:
    return Span(n if n else "(the model itself)", code=True)


def names(ns, k: int = 3) -> Text:
    """``a``, ``b`` and ``c`` (and 4 more)."""
    ns = list(ns)
    shown = ns[:k]
    parts: list[str | Span] = []
    for i, n in enumerate(shown):
        if i:
            parts.append(" and " if i == len(shown) - 1 and len(ns) <= k else ", ")
        parts.append(name(n))
    if len(ns) > k:
        parts.append(f" (and {len(ns) - k:,} more)")
    return text(*parts)


def step(s: int | None) -> str:
    return f"step {s:,}" if s is not None else "an unknown step"


def num(v, fmt: str = ".3g") -> str:
    try:
        return format(float(v), fmt)
    except (TypeError, ValueError):
        return "?"
