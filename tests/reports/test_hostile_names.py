"""Names from a hostile trace stay text, stay short and never break an output.

A real trace (a tiny model recorded by the Recorder) whose name tables and metadata were then
rewritten with h5py, as a trace attached to a bug ticket may be: HTML, Markdown and link
syntax, mathtext, 100,000-character names, CJK, emoji and right-to-left text. The real CLI (its
main, in this process: tests.helpers.invoke_cli) writes every output from it; each test looks at
one output as its reader would.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
from html.parser import HTMLParser

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from reports_testlib import pdf_pages_text, squeeze
from tests.helpers import invoke_cli
from tests.training import squared_error, train

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(1)>"
# Markdown: a table cell break, a code span, a javascript: link, emphasis, a heading, an autolink,
# an entity; and mathtext matplotlib cannot parse (it would fail the figure if parsed).
MARKDOWN = "|`y`[z](javascript:alert(1))*_# <https://evil>&amp;$\\notacommand{$"
UNICODE = "注意力_😀_עברית_مرحبا"
LONG = "model.layers.31." + "a" * 100_000 + ".mlp.down_proj"
# Modules of the model below: "3" is the dead ReLU (a dead_relu finding names it), and the
# weights of "0", "2" and "4" get no gradient (a vanishing_gradients finding names them).
MODULES = {"0": SCRIPT, "1": f"{UNICODE}_act", "2": LONG, "3": IMG + MARKDOWN, "4": UNICODE}
MODEL_CLASS = f"Net{SCRIPT}" + "C" * 90_000 + "_tail"  # the reader keeps 100,000 characters
HOST = f"{IMG}[x](javascript:alert(1))"
OPERATOR = "aten::" + "b" * 100_000
# Bounds no output may pass because of a name.
TERMINAL_LINE_CHARS = 1200
MARKDOWN_LINE_CHARS = 1200
SECONDS = 30


def _renamed(name: str) -> str:
    head, dot, tail = name.partition(".")
    return MODULES.get(head, head) + dot + tail


def _rewrite(ds_owner: h5py.File, key: str, values: list[str]) -> None:
    del ds_owner[key]
    ds_owner.create_dataset(key, data=np.array(values, dtype=object), dtype=h5py.string_dtype())


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """(run dir, analyze's result and seconds, info's result, {format: text or bytes})."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[2].bias.fill_(-100.0)  # the ReLU after it never fires: no gradient reaches the weights
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run_dir = train(model, tmp_path_factory.mktemp("hostile_names"), 40, (x, y), squared_error, optimizer=opt)
    with h5py.File(run_dir / "rank0.h5", "r+") as f:
        for key in ("modules/name", "params/name", "tensors/name"):
            _rewrite(f, key, [_renamed(n.decode()) for n in f[key][()]])
        if len(f["profile_ops/name"]):
            _rewrite(f, "profile_ops/name", [OPERATOR] + [n.decode() for n in f["profile_ops/name"][1:]])
        f.attrs["model_class"] = MODEL_CLASS
        f.attrs["host"] = HOST
        f.attrs["device"] = f"cpu {UNICODE}"
        f.attrs["model_summary"] = f"{MODEL_CLASS}(\n  (0): {SCRIPT}\n  (1): " + "x" * 100_000 + "\n)"
    out = tmp_path_factory.mktemp("hostile_names_out")
    paths = {fmt: out / f"report.{fmt}" for fmt in ("html", "pdf", "md", "json")}
    started = time.monotonic()
    # A warning logged where no handler is (fpdf2's) reaches a process's stderr through logging's
    # last resort; here pytest's handlers take it: caught beside stderr for the checks on stderr.
    logged = logging.StreamHandler(io.StringIO())
    logged.setLevel(logging.WARNING)
    logging.getLogger().addHandler(logged)
    try:
        analyzed = invoke_cli("analyze", run_dir, *(a for fmt, p in paths.items() for a in (f"--{fmt}", p)))
    finally:
        logging.getLogger().removeHandler(logged)
    analyzed.stderr += logged.stream.getvalue()
    seconds = time.monotonic() - started
    info = invoke_cli("info", run_dir)
    outputs = {fmt: (p.read_bytes() if fmt == "pdf" else p.read_text(encoding="utf-8"))
               for fmt, p in paths.items() if p.exists()}
    return run_dir, analyzed, seconds, info, outputs


# LONG (or one of its parameters) cut as the outputs show it: its start, an ellipsis, its end.
SHORTENED = re.compile(r"model\.layers\.31\.a+…a+\.mlp\.down_proj")


def test_every_output_is_written_quickly_without_a_traceback(hostile_run):
    _, analyzed, seconds, info, outputs = hostile_run
    assert analyzed.returncode in (0, 1), analyzed.stderr
    assert info.returncode == 0, info.stderr
    for r in (analyzed, info):
        assert "Traceback" not in r.stdout + r.stderr
    assert set(outputs) == {"html", "pdf", "md", "json"}
    assert seconds < SECONDS
    # fpdf2 logs a warning per font lacking a glyph: the PDF replaces such characters itself.
    assert "missing the following glyphs" not in analyzed.stderr


def test_json_keeps_names_exactly_as_the_trace_spells_them(hostile_run):
    findings = json.loads(hostile_run[4]["json"])["findings"]
    where = {f["kind"]: f["where"] for f in findings}
    assert where["dead_relu"] == [IMG + MARKDOWN]
    assert {f"{SCRIPT}.weight", f"{LONG}.weight", f"{UNICODE}.weight"} <= set(where["vanishing_gradients"])


def test_terminal_lines_are_short_and_names_cut_in_the_middle(hostile_run):
    _, analyzed, _, info, _ = hostile_run
    for r in (analyzed, info):
        assert max(len(line) for line in r.stdout.splitlines()) <= TERMINAL_LINE_CHARS
    assert SHORTENED.search(analyzed.stdout)  # a finding's where
    model = re.compile(re.escape(f"Net{SCRIPT}") + r"C+…C+_tail")
    assert model.search(analyzed.stdout.splitlines()[0])  # the run's description
    assert model.search(info.stdout)
    assert f"host         {HOST}, device cpu {UNICODE}" in info.stdout


class _Elements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.elements: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))


def test_html_holds_no_element_and_no_long_run_from_a_name(hostile_run):
    html = hostile_run[4]["html"]
    parser = _Elements()
    parser.feed(html)
    tags = [tag for tag, _ in parser.elements]
    assert "script" not in tags
    for tag, attrs in parser.elements:
        assert not any(a.startswith("on") for a in attrs), (tag, attrs)
        if tag == "img":  # the figures, and nothing else
            assert attrs["src"].startswith("data:image/png;base64,") and set(attrs) <= {"src", "alt", "width", "height"}
    for escaped in ("&lt;script&gt;alert(1)&lt;/script&gt;", "&lt;img src=x onerror=alert(1)&gt;"):
        assert escaped in html
    assert SHORTENED.search(html)
    for run in ("a" * 1000, "C" * 1000, "b" * 1000, "x" * 1000):
        assert run not in html
    assert "could not be drawn" not in html  # "$" in names is not parsed as mathtext


def test_markdown_shows_names_literally(hostile_run):
    md = hostile_run[4]["md"]
    for raw in (SCRIPT, IMG, "<https://evil>"):
        assert raw not in md
    named = "\n".join(line for line in md.splitlines() if line.startswith(("**Run:**", "**Verdict:**", "| ")))
    for unescaped in (r"\]\(javascript:", r"&amp;", r"<", r"`", r"\$"):  # the lines that hold names
        assert re.search(r"(?<!\\)" + unescaped, named) is None, unescaped
    assert r"\<script\>alert(1)\</script\>" in md
    assert r"\<img src=x onerror=alert(1)\>\|\`y\`\[z\](javascript:alert(1))\*\_\# \<https://evil\>\&amp;\$" in md
    assert max(len(line) for line in md.splitlines()) <= MARKDOWN_LINE_CHARS
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) >= 4  # header, rule, and a row per finding, each of six cells
    for row in rows:
        assert len(re.findall(r"(?<!\\)\|", row)) == 7, row
    assert re.search(re.escape(r"Net\<script\>alert(1)\</script\>") + r"C+…C+_tail", md)  # the run line


def test_pdf_parses_and_holds_the_names_cut(hostile_run):
    text = "\n".join(pdf_pages_text(hostile_run[4]["pdf"]))
    flat = squeeze(text)
    assert SHORTENED.search(flat)
    assert "a" * 1000 not in flat and "C" * 1000 not in flat
    assert squeeze(f"{SCRIPT}.weight") in flat  # markup prints as the characters it is
    # The fonts (DejaVu) have no CJK or emoji: those print as "?", the rest of the name as it is.
    assert "???_?_" in flat
    from pypdf import PdfReader

    assert len(PdfReader(io.BytesIO(hostile_run[4]["pdf"])).pages) < 40
