"""Typed evidence: each detector declares its evidence keys (a TypedDict named ``Evidence``); its
findings carry only those keys, and the reports read only declared keys, so renaming a key on
one side fails here instead of silently dropping a line from a report."""

from __future__ import annotations

import ast
import glob
import os

import pytest

from torchautopsy.analyzer.cross_rank import CROSS_DETECTORS
from torchautopsy.analyzer.detectors import DETECTORS as PER_RANK
from torchautopsy.analyzer.findings import Evidence, evidence_keys
from torchautopsy.analyzer.run import RUNNER_EVIDENCE, analyze
from torchautopsy.analyzer.trace import load

DETECTORS = (*PER_RANK, *CROSS_DETECTORS)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {d.KIND: evidence_keys(d.Evidence) for d in DETECTORS} | \
    {kind: evidence_keys(t) for kind, t in RUNNER_EVIDENCE.items()}


def test_every_detector_declares_its_evidence():
    for d in DETECTORS:
        assert Evidence.__annotations__.keys() <= d.Evidence.__annotations__.keys(), d.KIND
        assert d.Evidence.__annotations__.keys() - Evidence.__annotations__.keys(), f"{d.KIND} declares no keys"


def _evidence_reads(tree: ast.AST) -> set[str]:
    """String keys read from an ``.evidence`` dict (or a name bound to one) in this source:
    ``x.evidence["k"]``, ``x.evidence.get("k")``, ``"k" in x.evidence``."""
    aliases = {t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
               and isinstance(n.value, ast.Attribute) and n.value.attr == "evidence"
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}

    def is_evidence(x) -> bool:
        return isinstance(x, ast.Attribute) and x.attr == "evidence" or isinstance(x, ast.Name) and x.id in aliases

    def key(x) -> str | None:
        return x.value if isinstance(x, ast.Constant) and isinstance(x.value, str) else None

    keys = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and is_evidence(n.value):
            keys.add(key(n.slice))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" \
                and is_evidence(n.func.value) and n.args:
            keys.add(key(n.args[0]))
        elif isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.In, ast.NotIn)) \
                and is_evidence(n.comparators[0]):
            keys.add(key(n.left))
    return keys - {None}


def _module_kind(tree: ast.AST) -> str | None:
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "KIND" for t in n.targets):
            return n.value.value
    return None


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "reports", "**", "*.py"), recursive=True)),
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_reports_read_only_declared_evidence(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    kind = _module_kind(tree)
    allowed = KEYS[kind] if kind else frozenset().union(*KEYS.values())
    undeclared = _evidence_reads(tree) - allowed
    assert not undeclared, f"{os.path.relpath(path, ROOT)} reads evidence keys no detector of " \
                           f"{kind or 'any kind'} declares: {sorted(undeclared)}"


def test_the_reader_check_sees_a_misspelt_key():
    tree = ast.parse("def f(x):\n    ev = x.evidence\n    e2: dict = x.evidence\n"
                     "    return ev.get('stag'), x.evidence['stage'], 'r2' in ev, e2['lr']\n")
    assert _evidence_reads(tree) == {"stag", "stage", "r2", "lr"}


def undeclared_keys(findings) -> list[tuple[str, list[str]]]:
    """(kind, keys) of findings whose evidence carries keys their kind does not declare."""
    bad = [(f.kind, sorted(set(f.evidence) - KEYS[f.kind])) for f in findings]
    return [b for b in bad if b[1]]


@pytest.mark.parametrize("sample", sorted(d for d in os.listdir(os.path.join(ROOT, "sample_traces"))
                                          if os.path.isdir(os.path.join(ROOT, "sample_traces", d))
                                          and glob.glob(os.path.join(ROOT, "sample_traces", d, "*.h5"))))
def test_findings_on_the_samples_carry_only_declared_evidence(sample):
    found = analyze(load(os.path.join(ROOT, "sample_traces", sample)))
    assert not undeclared_keys(found)
