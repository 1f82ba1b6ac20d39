"""docs/trace_format.md holds the per-step tables as torchautopsy/trace_schema.py spells them
(the literal the recorder writes by and the analyzer reads by): every column named in its
table with its dtype, a Versions row for every version, and each column added after the first
traces named in a row of the version it came in. Torch-free: the doc and the literal only."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import sys

import pytest

from torchautopsy import trace_schema
from torchautopsy.trace_schema import ORIGINAL, PER_STEP, PER_STEP_TABLES, SCHEMA_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = {"int8": "i1", "int32": "i4", "int64": "i8", "uint8": "u1", "float32": "f4", "float64": "f8"}
# The line that opens each per-step table in the doc.
TABLE_INTRO = {"steps": "`steps/`:", "params": "`params/` (", "modules": "`modules/` ("}


@pytest.fixture(scope="module")
def doc() -> list[str]:
    with open(os.path.join(ROOT, "docs", "trace_format.md"), encoding="utf-8") as f:
        return f.read().splitlines()


def _rows_after(lines: list[str], start: int) -> list[list[str]]:
    """The body rows of the first Markdown table after line ``start``, as cells (``\\|`` is a
    pipe inside a cell)."""
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
        elif rows:
            break
    return rows[2:]  # (the header and its rule)


def _line(lines: list[str], prefix: str, after: int = 0) -> int:
    return next(k for k in range(after, len(lines)) if lines[k].startswith(prefix))


def _doc_columns(lines: list[str], table: str) -> dict[str, str]:
    """{column: numpy dtype} of a per-step table as the doc lists it."""
    section = _line(lines, "## Per-step tables")
    out = {}
    for cells in _rows_after(lines, _line(lines, TABLE_INTRO[table], section)):
        names = re.findall(r"`([^`]+)`", cells[0])
        dtypes = [DTYPES[w.strip()] for w in cells[1].split(",")]
        assert len(dtypes) in (1, len(names)), cells[:2]
        out.update(zip(names, dtypes * len(names) if len(dtypes) == 1 else dtypes))
    return out


def _versions(lines: list[str]) -> list[tuple[str, str]]:
    """(schema, change) of each row of the doc's Versions table."""
    return [(cells[0], cells[2]) for cells in _rows_after(lines, _line(lines, "## Versions"))]


@pytest.mark.parametrize("table", PER_STEP_TABLES)
def test_the_doc_names_every_column_with_its_dtype(doc, table):
    want = {c.name: c.dtype for c in trace_schema.columns(table)}
    assert _doc_columns(doc, table) == want


def test_the_doc_is_of_the_current_version(doc):
    assert doc[0] == f"# torchautopsy trace format, schema version {SCHEMA_VERSION}"


def test_every_version_has_a_row_and_names_the_columns_it_added(doc):
    rows = _versions(doc)
    assert rows[0] == ("1", "first version")
    assert {schema for schema, _ in rows} == {str(v) for v in range(1, SCHEMA_VERSION + 1)}
    for c in PER_STEP:
        if c.since == ORIGINAL:
            continue
        named = [t for schema, change in rows if schema == str(c.since) for t in re.findall(r"`([^`]+)`", change)]
        assert any(fnmatch.fnmatchcase(c.path, t) for t in named), \
            f"{c.path} came in schema {c.since}: no Versions row of that schema names it"


def test_the_literal_is_whole():
    paths = [c.path for c in PER_STEP]
    assert len(paths) == len(set(paths))
    for c in PER_STEP:
        assert c.table in PER_STEP_TABLES and c.dtype in DTYPES.values(), c
        assert c.width in (trace_schema.ONE, trace_schema.PER_PARAM, trace_schema.PER_MODULE), c
        assert c.since == ORIGINAL or 1 <= c.since <= SCHEMA_VERSION, c
        # An added column says what older traces read as; a first one has no older traces.
        assert (c.older is None) == (c.since == ORIGINAL), c
    assert [c.name for c in trace_schema.columns("steps")][:1] == ["step"]


def test_the_literal_imports_only_the_stdlib():
    with open(trace_schema.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m.split(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"__future__"}, imported
