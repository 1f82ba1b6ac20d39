"""What the reader checks of a trace's content when it opens a rank file: the run's attributes,
the name lists and the per-step tables every detector reads. safety.py has checked the file's
structure before; these checks make a damaged or crafted trace fail here, with one line, rather
than deep inside a detector or a report.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import TraceFormatError
from .format import clean_text, parse_json

# Root attributes the analyzer reads, by type; one of another type (a string where the rank
# goes) is dropped, and reads as unknown.
_INT_ATTRS = ("rank", "world_size", "n_parameters", "n_steps_recorded", "dropped_steps", "dropped_rows",
              "pid", "schema_version")
_FLOAT_ATTRS = ("start_unix", "end_unix")
_BOOL_ATTRS = ("closed",)
_TEXT_CUT = 100_000  # characters of a text attribute kept (a model summary can be long)
# A model with more parameter tensors or modules than this is not one the recorder has seen
# (the largest mixture-of-experts models have tens of thousands); more is a crafted trace, and
# would make every steps x tensors read of the analyzer wide beyond its memory bound.
MAX_TENSORS = 200_000
_CONFIG_KEYS = 500
# Steps of a rank the analyzer reads: its 1-D per-step series are read whole (8 bytes a step a
# column); ten times the longest runs measured (benchmarks/analyzer_scale.py: 1M steps).
MAX_STEPS = 10_000_000


def clean_meta(meta: dict) -> dict:
    """The root attributes with the known ones of the wrong type or out of range dropped,
    texts cut, and ``config`` parsed into a flat dict of plain values."""
    out = {}
    for k, v in meta.items():
        if k in _INT_ATTRS:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**53:
                continue
        elif k in _FLOAT_ATTRS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            v = float(v)
        elif k in _BOOL_ATTRS:
            if not isinstance(v, (bool, int)):
                continue
            v = bool(v)
        elif isinstance(v, str):
            v = v[:_TEXT_CUT]
        elif not isinstance(v, (int, float, bool)):
            continue  # arrays and other shapes: nothing the analyzer reads
        out[k] = v
    out["config"] = _config(meta.get("config"))
    return out


def _config(text) -> dict:
    """The recorder's settings (a JSON object of plain values); anything else reads as {}."""
    if not isinstance(text, str) or len(text) > 1_000_000:
        return {}
    cfg = parse_json(text)
    if not isinstance(cfg, dict):
        return {}
    out = {}
    for k, v in list(cfg.items())[:_CONFIG_KEYS]:
        if isinstance(v, float) and not math.isfinite(v):
            continue
        if isinstance(v, str):
            v = clean_text(v[:1000], lines=False)
        elif isinstance(v, list):
            v = [clean_text(x[:1000], lines=False) if isinstance(x, str) else x
                 for x in v[:100] if isinstance(x, (int, float, str, bool))]
        elif v is not None and not isinstance(v, (int, float, bool)):
            continue
        out[clean_text(str(k)[:200], lines=False)] = v
    return out


def check_names(path: str, names: dict[str, int]) -> None:
    """The name lists of a table agree in length and are not absurdly long."""
    for what, lists in (("params", ("name", "shape", "numel")), ("modules", ("name", "type", "is_leaf"))):
        lengths = {c: names[f"{what}/{c}"] for c in lists}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{what}/{c}: {n:,}" for c, n in lengths.items())
            raise TraceFormatError(f"{path}: the {what} lists differ in length ({shown}); the trace is "
                                   "damaged and cannot be analyzed")
        if lengths["name"] > MAX_TENSORS:
            raise TraceFormatError(f"{path} lists {lengths['name']:,} {what}, more than torchautopsy "
                                   f"reads ({MAX_TENSORS:,}); the trace is damaged or crafted")


def check_step_table(path: str, f, tables: dict[str, tuple[str, ...]], widths: dict[str, int]) -> None:
    """The per-step datasets hold numbers, the 2-D ones as wide as their name list."""
    for table, cols in tables.items():
        for c in cols:
            name = f"{table}/{c}"
            ds = f[name]
            if ds.dtype.kind not in "iufb":
                raise TraceFormatError(f"{path}: {name} holds {ds.dtype}, not numbers; the trace is damaged")
            want = widths.get(table)
            if want is None and ds.ndim != 1 or want is not None and ds.shape[1:] != (want,):
                raise TraceFormatError(f"{path}: {name} has shape {ds.shape}, which does not match its "
                                       f"table; the trace is damaged")


def check_step_count(path: str, n: int) -> None:
    if n > MAX_STEPS:
        raise TraceFormatError(f"{path} declares {n:,} steps, more than torchautopsy reads ({MAX_STEPS:,}); "
                               "the trace is damaged or crafted")


def check_step_numbers(path: str, steps: np.ndarray) -> None:
    """Steps are whole numbers, >= 0, increasing: every detector and figure relies on it."""
    if steps.dtype.kind not in "iu":
        raise TraceFormatError(f"{path}: steps/step holds {steps.dtype}, not whole numbers; the trace is damaged")
    if steps.size and (int(steps.min()) < 0 or int(steps.max()) >= 2**53):
        raise TraceFormatError(f"{path}: steps/step holds step numbers out of range "
                               f"({int(steps.min()):,} to {int(steps.max()):,}); the trace is damaged")
    bad = np.flatnonzero(np.diff(steps.astype(np.int64)) <= 0)
    if bad.size:
        i = int(bad[0])
        raise TraceFormatError(f"{path}: steps/step goes from {int(steps[i]):,} to {int(steps[i + 1]):,} "
                               f"at row {i + 1:,}, not forward; the trace is damaged")


def numeric(path: str, name: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` if it holds numbers; a one-line error if a damaged trace put strings there."""
    if arr.dtype.kind not in "iufb":
        raise TraceFormatError(f"{path}: {name} holds {arr.dtype}, not numbers; the trace is damaged")
    return arr
