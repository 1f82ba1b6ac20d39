"""Constants and helpers shared by the report tests (conftest.py builds the traces)."""

from __future__ import annotations

import io
import re
import subprocess
from functools import lru_cache
from pathlib import Path

from PIL import Image, ImageStat

# Module names as a trace attached to a bug ticket may hold them: they must stay text.
HOSTILE_SCRIPT = "<script>alert(1)</script>"
HOSTILE_IMG = "<img src=x onerror=alert(1)>"
# A name too long for any column, and one in scripts the report's fonts only partly cover.
HOSTILE_LONG = "block_" + "x" * 150
HOSTILE_UNICODE = "слой_注意_{nb}"

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_traces"
_FOOTER = re.compile(r"^torchautopsy report: .* page \d+ of \d+$")


def pdf_pages_text(pdf: bytes) -> list[str]:
    """The text of each page, without the page footer."""
    from pypdf import PdfReader

    pages = []
    for page in PdfReader(io.BytesIO(pdf)).pages:
        lines = [ln for ln in page.extract_text().splitlines() if not _FOOTER.match(ln.strip())]
        pages.append("\n".join(lines))
    return pages


def pdf_page_count(pdf: bytes) -> int:
    """The number of pages, without extracting their text (the costly part)."""
    from pypdf import PdfReader

    return len(PdfReader(io.BytesIO(pdf)).pages)


def squeeze(text: str) -> str:
    """Text without any whitespace: a PDF wraps lines wherever the width ends."""
    return "".join(text.split())


def pixel_spread(png: bytes) -> float:
    """Standard deviation of the grey levels: about 0 for a blank page or screenshot."""
    return ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]


def render_pdf_pages(pdftoppm: str, pdf: Path, out_dir: Path, dpi: int = 40) -> list[Path]:
    subprocess.run([pdftoppm, "-r", str(dpi), "-png", str(pdf), str(out_dir / "page")], check=True,
                   capture_output=True, timeout=120)
    return sorted(out_dir.glob("page*.png"))


def sample_cases() -> list[str]:
    import json

    path = SAMPLES / "expected.json"
    return sorted(json.loads(path.read_text())) if path.exists() else []


@lru_cache(maxsize=None)
def sample_report(case: str):
    """(trace, findings, report, html, pdf) of a shipped sample trace, built once per session."""
    from torchautopsy import load
    from torchautopsy.analyzer.run import analyze
    from torchautopsy.reports import build_report, render_html, render_pdf

    trace = load(SAMPLES / case)
    findings = analyze(trace)
    report = build_report(trace, findings)
    return trace, findings, report, render_html(report), render_pdf(report)
