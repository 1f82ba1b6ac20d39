"""`torchautopsy diff RUN_A RUN_B` as a user runs it (the real CLI without torch, on the shipped
sample traces): the JSON contract, --fail-on parted, the Markdown, HTML and PDF reports, and one
line with exit code 2 for what cannot be compared. The gate in a real process (its exit code is
what CI sees); the rest in process (tests.helpers.invoke_cli: the same main, torch hidden)."""

from __future__ import annotations

import json

from tests.helpers import SAMPLES, invoke_cli, run_cli

HEALTHY = SAMPLES / "healthy_mlp"
BLOWN = SAMPLES / "exploding_lr"  # the same MLP, SGD at lr 0.025: diverges and goes NaN
WIDE = SAMPLES / "leak_losses_mlp"  # the MLP 256 wide, its loss kept: parts at step 0 in fc2.weight
RANKS = SAMPLES / "ddp_straggler"  # 4 ranks


def test_a_run_against_itself_is_identical_and_passes_the_gate(tmp_path):
    out = tmp_path / "d.json"
    r = run_cli("diff", HEALTHY, HEALTHY, "--json", out, "--fail-on", "parted", block_torch=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text()) == {"identical": True, "parted": None, "setup": [],
                                           "new_findings": {"a": [], "b": []}}
    assert "B is identical to A, to the bit, over the 300 step(s) both recorded." in r.stdout


def test_a_blown_up_run_parts_and_fails_the_gate(tmp_path):
    r = invoke_cli("diff", HEALTHY, BLOWN, "--json", "-", "--fail-on", "parted", "--md", tmp_path / "d.md")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"identical", "parted", "setup", "new_findings"}
    assert doc["identical"] is False
    p = doc["parted"]
    # The same data, another initialisation (the sample's seeds 0 and 5): at step 0 the forward
    # parts first, before the update's learning rate (the order the step computes them).
    assert set(p) == {"step", "where", "what", "ratio"} and p["step"] == 0 and p["where"] == ["fc1"]
    assert p["what"].startswith("output of fc1 (max |x|)") and 1.01 < p["ratio"] < 1.05
    assert {"name": "optimizer", "a": "Adam", "b": "SGD"} in doc["setup"]
    assert {"name": "lr", "a": 0.001, "b": 0.025} in doc["setup"]
    new_b = {f["kind"] for f in doc["new_findings"]["b"]}
    assert {"nonfinite", "exploding_gradients"} <= new_b and doc["new_findings"]["a"] == []
    assert all(set(f) >= {"kind", "severity", "step", "where", "summary", "evidence", "advice"}
               for f in doc["new_findings"]["b"])
    md = (tmp_path / "d.md").read_text()
    assert "**Verdict:** B parts from A at step 0, first in the output of fc1" in md
    assert "; setup: optimizer Adam → SGD, lr 0.001 → 0.025." in md  # what differs, in the verdict
    assert "| optimizer | Adam | SGD |" in md
    # The terminal report went to stderr (stdout holds the JSON alone).
    assert "B parts from A at step 0" in r.stderr and "New in B:" in r.stderr


def test_ranks_are_chosen_or_refused_in_one_line(tmp_path):
    r = invoke_cli("diff", HEALTHY, RANKS)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("Error: A has 1 rank(s) and B 4: give --rank R")
    r = invoke_cli("diff", RANKS, RANKS, "--rank", "2", "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["identical"] is True, r.stderr
    assert "[rank 2, 150 steps]" in r.stderr
    r = invoke_cli("diff", RANKS, RANKS, "--rank", "7")
    assert r.returncode == 2 and "has no rank 7 (it has 0, 1, 2, 3)" in r.stderr


def test_what_is_not_a_run_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "notes.txt").write_text("not a trace")
    for args in ((HEALTHY, tmp_path / "missing"), (tmp_path / "notes.txt", HEALTHY), (HEALTHY,)):
        r = invoke_cli("diff", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("Error") and r.stderr.strip().count("\n") == 0, r.stderr
        assert "Traceback" not in r.stderr


def test_the_html_report_stands_alone_and_shows_the_parting(tmp_path):
    out = tmp_path / "diff.html"
    r = invoke_cli("diff", HEALTHY, BLOWN, "--html", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    # Self-contained: figures inline, no script, nothing fetched.
    assert "<script" not in html and "http://" not in html and "https://" not in html
    # loss, lr, gradient norm, the per-parameter and the per-module pictures
    assert html.count('src="data:image/png;base64,') == 5
    assert "Output of each module (max |x|), log10(B / A) over the watched steps" in html
    assert "B parts from A at step 0, first in the output of fc1 (max |x|)" in html
    assert "<td>optimizer</td><td class=\"name\">Adam</td><td class=\"name\">SGD</td>" in html
    assert "New in B" in html and "nonfinite at step 48 in fc2" in html


def _pdf(path):
    """The PDF's text (squeezed: pages wrap wherever the width ends) and its images, read by pypdf."""
    from pypdf import PdfReader

    pages = PdfReader(path).pages
    return "".join("".join(p.extract_text().split()) for p in pages), [im.image for p in pages for im in p.images]


def test_the_pdf_report_gives_the_verdict_then_the_figures_setup_and_new_findings(tmp_path):
    out = tmp_path / "diff.pdf"
    r = invoke_cli("diff", HEALTHY, WIDE, "--pdf", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout and out.read_bytes().startswith(b"%PDF-")
    text, images = _pdf(out)
    verdict = text.index("BpartsfromAatstep0,firstintheweightnormoffc2.weight(2.02xA's)")
    setup = text.index("parameters9473136193")  # the setup table's row: setting, A, B
    assert "shapeoffc2.weight[64,64][256,256]" in text
    new = text.index("NewinB•warningmemory_leakatstep0")
    assert verdict < text.index("Loss") < text.index("log10(B/A)") < setup < new
    # The overlays (loss, lr, gradient norm) and the per-parameter picture, as drawn (7 in at 150 dpi).
    assert len(images) == 5 and all(im.width == 1050 for im in images), [im.size for im in images]


def test_an_identical_pair_gives_a_pdf_that_says_so_and_pdf_is_never_stdout(tmp_path):
    out = tmp_path / "same.pdf"
    r = invoke_cli("diff", HEALTHY, HEALTHY, "--pdf", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    text, images = _pdf(out)
    assert "BisidenticaltoA,tothebit,overthe300step(s)bothrecorded." in text
    assert "Nodifferencerecordedinthesetup." in text and "Findingsonlyonerunhas" not in text
    assert len(images) == 5
    r = invoke_cli("diff", HEALTHY, HEALTHY, "--pdf", "-")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "PDF is not written to stdout" in r.stderr
