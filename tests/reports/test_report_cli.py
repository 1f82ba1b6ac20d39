"""`torchautopsy analyze --html --pdf --md [--open]`: every report in one pass, through the real CLI:
in a fresh interpreter where torch cannot be imported for the one pass (the reports need no torch),
in this process (tests.helpers.invoke_cli) for the rest."""

from __future__ import annotations

import sys

from reports_testlib import SAMPLES, pdf_pages_text, sample_cases, squeeze

from tests.helpers import invoke_cli, run_cli


def test_html_pdf_md_and_json_in_one_pass_without_torch(tmp_path):
    case = "nan_birth" if "nan_birth" in sample_cases() else None
    run_dir = SAMPLES / case if case else None
    if run_dir is None:
        import pytest

        pytest.skip("sample_traces/nan_birth is missing")
    out = {ext: tmp_path / f"report.{ext}" for ext in ("html", "pdf", "md", "json")}
    r = run_cli("analyze", run_dir, "--html", out["html"], "--pdf", out["pdf"], "--md", out["md"],
                "--json", out["json"], block_torch=True)
    assert r.returncode == 0, r.stderr
    for ext, path in out.items():
        assert f"wrote {path}" in r.stdout
        assert path.stat().st_size > 0, ext
    assert r.stderr.strip() == ""  # no progress bar when stderr is not a terminal, no warning
    html = out["html"].read_text()
    assert "features.log" in html and "nonfinite" in html
    text = squeeze("\n".join(pdf_pages_text(out["pdf"].read_bytes())))
    assert squeeze("NaN/Inf appeared at step 60 in the forward pass of features.log") in text
    assert len(out["md"].read_text().splitlines()) <= 40


def test_unwritable_pdf_is_one_line_before_the_analysis(tmp_path):
    r = invoke_cli("analyze", SAMPLES / "healthy_mlp", "--pdf", tmp_path / "no" / "such" / "dir.pdf")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: cannot write") and "dir.pdf" in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""  # said before any analysis


def test_open_hands_the_html_to_the_browser_and_progress_shows_when_asked(healthy_dir, tmp_path, monkeypatch):
    opened = tmp_path / "opened.txt"
    # webbrowser runs $BROWSER with %s replaced by the URL: a tiny "browser" that notes it.
    browser = f"{sys.executable} -c \"import sys; open(r'{opened}', 'w').write(sys.argv[1])\" %s"
    monkeypatch.setenv("BROWSER", browser)
    monkeypatch.setenv("TORCHAUTOPSY_PROGRESS", "1")
    # (webbrowser reads $BROWSER at its first use in a process: here, the suite's only --open)
    r = invoke_cli("analyze", healthy_dir, "--open")
    assert r.returncode == 0, r.stderr
    written = [ln.removeprefix("wrote ") for ln in r.stdout.splitlines() if ln.startswith("wrote ")]
    assert len(written) == 1 and written[0].endswith(".html")  # no --html: a temporary file
    url = opened.read_text()
    assert url.startswith("file://") and url.endswith(written[0])
    assert "torchautopsy:" in r.stderr and "100%" in r.stderr  # the progress bar, on stderr
