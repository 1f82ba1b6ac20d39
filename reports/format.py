"""Numbers and evidence as a reader wants them, as plain text (each renderer escapes it)."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass, replace

import numpy as np

from ..analyzer.display import REPORT_NAME_CHARS, TEXT_CHARS, TITLE_CHARS, WORD_CHARS, shorten, shorten_words
from .model import EvidenceRow

# Evidence is shown in full up to these bounds; a trace could hold a dict of every parameter.
MAX_EVIDENCE_ITEMS = 40
MAX_EVIDENCE_DEPTH = 3
MAX_TEXT_CHARS = 4000
# Records of a list (slow steps, tensor groups) shown one per row, at most this many.
MAX_RECORDS = 5
# A cell of a report's tables: a PDF row must fit on a page even in a narrow column.
CELL_CHARS = 300
# Fields of the report's data cut tighter than running text (TEXT_CHARS).
_FIELD_CHARS = {"rows": CELL_CHARS, "where": REPORT_NAME_CHARS, "columns": REPORT_NAME_CHARS,
                "title": TITLE_CHARS}

__all__ = ["REPORT_NAME_CHARS", "bounded", "evidence_rows", "format_bytes", "format_duration", "format_number",
           "format_value", "map_strings", "plural", "shorten", "shorten_words"]


def evidence_rows(evidence: dict, depth: int = 0) -> list[EvidenceRow]:
    """``[(label, value)]`` where each value is a string or, for a nested dict, rows again. A
    finding's own keys read as words (``loss_before`` -> "Loss before"), its values with their
    units; keys further down may be names from the trace (parameter -> value): shown as named, cut."""
    items = list(evidence.items())
    rows: list[EvidenceRow] = [(label(str(k)) if depth == 0 else shorten(str(k), REPORT_NAME_CHARS),
                                _evidence_value(v, depth, str(k))) for k, v in items[:MAX_EVIDENCE_ITEMS]]
    if len(items) > MAX_EVIDENCE_ITEMS:
        rows.append(("…", f"{len(items) - MAX_EVIDENCE_ITEMS} more entries not shown"))
    return rows


def _evidence_value(v, depth: int, key: str = ""):
    if isinstance(v, dict) and v and depth < MAX_EVIDENCE_DEPTH:
        return evidence_rows(v, depth + 1)
    if (isinstance(v, (list, tuple)) and v and len(v) <= MAX_EVIDENCE_ITEMS and depth < MAX_EVIDENCE_DEPTH - 1
            and all(isinstance(d, dict) and d for d in v)):
        # A list of records (the slowest steps, tensor groups): one row each, not one run of braces;
        # the first MAX_RECORDS (the JSON output holds them all).
        by_step = all("step" in d for d in v) and len({str(d["step"]) for d in v}) == len(v)
        rows: list[EvidenceRow] = [((f"step {format_value(d['step'])}" if by_step else f"#{i + 1}"),
                                    format_value({k: x for k, x in d.items() if not (by_step and k == "step")})[1:-1])
                                   for i, d in enumerate(v[:MAX_RECORDS])]
        if len(v) > MAX_RECORDS:
            rows.append(("…", f"{len(v) - MAX_RECORDS} more (the JSON findings, analyze --json, hold them all)"))
        return rows
    return format_value(v, key)


def label(key: str) -> str:
    """An evidence key as words: ``first_death_step`` -> "First death step"."""
    words = key.replace("_", " ").strip()
    return shorten(words[:1].upper() + words[1:], REPORT_NAME_CHARS) if words else key


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.number)) and not isinstance(v, bool)


def _is_share(key: str, v) -> bool:
    """A share of a whole (0..1): ``dead_share``, ``zero_frac``: shown as a percentage."""
    return key.endswith(("_share", "_frac", "_fraction")) and _is_number(v) and 0 <= v <= 1


def _is_step_span(key: str, v) -> bool:
    return key.endswith("_steps") and isinstance(v, (list, tuple)) and len(v) == 2 and all(
        _is_number(x) and float(x).is_integer() for x in v)


def _is_seconds(key: str, v) -> bool:
    return (key == "s" or key.endswith("_s")) and isinstance(v, (int, float, np.number)) and not isinstance(v, bool)


def _seconds(v: float) -> str:
    v = float(v)
    if not math.isfinite(v):
        return format_value(v)
    return f"{v * 1e3:.3g} ms" if abs(v) < 1 else f"{v:.3g} s"


def _is_byte_count(key: str, v) -> bool:
    return ((key.endswith("bytes") or key.endswith("bytes_per_step")) and isinstance(v, (int, float, np.number))
            and not isinstance(v, bool) and math.isfinite(v))


def _byte_count(v, key: str) -> str:
    """A byte count as read with its size beside it; -1, the recorder's "not known", named."""
    per = " per step" if key.endswith("per_step") else ""
    if v < 0:
        return "not recorded" if v == -1 else f"{v:.4g} (-{format_bytes(-v)}{per})"
    exact = f"{int(v):,}" if float(v).is_integer() else f"{v:.4g}"
    return f"{exact} ({format_bytes(v)}{per})" if v >= 1024 else f"{exact} B{per}"


def format_value(v, key: str = "") -> str:
    """A number or small structure as a reader wants it: 4 significant digits, NaN/Inf named;
    a count of bytes (``key`` ending in "bytes") with its size in KiB/MiB/GiB."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None:
        return "-"
    if _is_byte_count(key, v):
        return _byte_count(v, key)
    if _is_seconds(key, v):
        return _seconds(v)
    if _is_share(key, v):
        return f"{100 * float(v):.3g}%"
    if _is_step_span(key, v):
        return f"steps {int(v[0]):,}-{int(v[1]):,}"
    if (key == "step" or key.endswith("_step")) and _is_number(v) and float(v).is_integer() and v >= 0:
        return f"step {int(v):,}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Inf" if v > 0 else "-Inf"
        return f"{v:.0f}" if 1e4 <= abs(v) < 1e6 else f"{v:.4g}"  # 12346, not 1.235e+04
    if isinstance(v, (list, tuple)):
        shown = ", ".join(format_value(x) for x in v[:MAX_EVIDENCE_ITEMS])
        more = f", … ({len(v)} items)" if len(v) > MAX_EVIDENCE_ITEMS else ""
        return f"[{shown}{more}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {format_value(x, str(k))}" for k, x in v.items()) + "}"
    text = str(v)
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + " …(truncated)"


def format_number(v: float | None) -> str:
    """A statistic in a table cell: 3 significant digits; NaN, Inf and absent named."""
    if v is None:
        return ""
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    if v == 0:
        return "0"
    return f"{v:.3g}"


def format_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def format_duration(s: float) -> str:
    if not math.isfinite(s):
        return "unknown"
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def bounded(obj):
    """A report's data with every string cut by shorten_words: a name or text from the trace,
    however long, cannot break a renderer's layout or take minutes to lay out."""
    return map_strings(obj, lambda text, field: shorten_words(text, WORD_CHARS,
                                                              _FIELD_CHARS.get(field, TEXT_CHARS)))


def map_strings(obj, fn, field: str = ""):
    """``obj`` (dataclasses, lists, tuples) with every string ``s`` replaced by ``fn(s, field)``,
    ``field`` the name of the dataclass field holding it. Bytes (figures) and numbers are kept."""
    if isinstance(obj, str):
        return fn(obj, field)
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: map_strings(getattr(obj, f.name), fn, f.name) for f in fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_strings(x, fn, field) for x in obj)
    return obj
