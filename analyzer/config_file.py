"""Detector thresholds from a TOML file: ``torchautopsy analyze RUN_DIR --config thresholds.toml``.

One table per detector kind, holding the fields of that detector's config dataclass
(each detector's CONFIG, collected in analyzer/config.py); what the file leaves out keeps its default::

    [exploding_gradients]
    sustained_ratio = 50

    [update_ratio]
    too_large = 0.2

An unknown table or key, a value of the wrong type or out of range, or a file that is not TOML
raises ConfigError naming the file, the table and the key and listing the valid ones. Reading
TOML needs ``tomllib`` (Python 3.11+) or, on Python 3.10, the ``tomli`` package.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import typing

from .config import AnalysisConfig
from .errors import ConfigError

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _toml():
    try:
        import tomllib
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return None
    return tomllib


def load_config(path) -> AnalysisConfig:
    """The default AnalysisConfig with the thresholds set in the TOML file at ``path``."""
    path = os.fspath(path)
    toml = _toml()
    if toml is None:
        raise ConfigError(f"{path}: a TOML config needs Python 3.11 or newer (tomllib); this is "
                          f"Python {sys.version.split()[0]} (or: pip install tomli)")
    try:
        with open(path, "rb") as f:
            doc = toml.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; give a TOML file with one table per detector, "
                          "e.g. [update_ratio] too_large = 0.2") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; give a TOML file") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not a UTF-8 text file, so not TOML ({e.reason})") from None
    except toml.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    return config_from_dict(doc, path)


def config_from_dict(doc: dict, source: str = "config") -> AnalysisConfig:
    """AnalysisConfig from ``{kind: {field: value}}`` (a parsed TOML file; ``source`` names it)."""
    base = AnalysisConfig()
    tables = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    valid_tables = ", ".join(f"[{t}]" for t in tables)
    changes = {}
    for name, table in doc.items():
        if name not in tables and not isinstance(table, dict):
            raise ConfigError(f"{source}: setting '{name}' is outside any table; put it under the "
                              f"table of its detector, one of {valid_tables}")
        if name not in tables:
            raise ConfigError(f"{source}: unknown table [{name}]; valid tables (one per detector): "
                              f"{valid_tables}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: '{name}' must be a table ([{name}] followed by its "
                              f"settings), got {_describe(table)}; valid tables: {valid_tables}")
        changes[name] = _table(tables[name], name, table, source)
    return dataclasses.replace(base, **changes)


def _table(default, name: str, table: dict, source: str):
    cls = type(default)
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    valid = ", ".join(fields) if fields else f"none ([{name}] has no settings)"
    values = {}
    for key, value in table.items():
        if key not in fields:
            raise ConfigError(f"{source}: [{name}] has no setting '{key}'; valid keys: {valid}")
        values[key] = _convert(value, hints[key], f"{source}: [{name}] {key}")
    try:
        return dataclasses.replace(default, **values)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: [{name}] {e}") from None


def _convert(value, hint, where: str):
    """value as the field's type, or ConfigError saying what was expected."""
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {_describe(value)}")
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        items = [_convert(v, args[0], where) for v in value] if args else list(value)
        return tuple(items) if origin is tuple else items
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {_describe(value)}")
        if math.isnan(value):
            raise ConfigError(f"{where} must be a number, got nan")
        return float(value)
    if hint in (int, bool, str):
        if isinstance(value, bool) != (hint is bool) or not isinstance(value, hint):
            raise ConfigError(f"{where} must be {_TYPE_NAMES[hint]}, got {_describe(value)}")
        return value
    return value  # a type this loader does not know: the dataclass checks it, if it does


def _describe(value) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} ({text[:40] + '...' if len(text) > 40 else text})"
