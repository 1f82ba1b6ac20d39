"""The PDF report: the same content as the HTML, paginated, its pages drawn, names kept as text."""

from __future__ import annotations

from reports_testlib import (HOSTILE_IMG, HOSTILE_LONG, HOSTILE_SCRIPT, HOSTILE_UNICODE, pdf_pages_text,
                             pixel_spread, render_pdf_pages, squeeze)

from torchautopsy.reports import render_pdf


def test_pdf_holds_the_header_verdict_every_finding_and_the_appendix(diverged_built):
    _, findings, report, _, pdf = diverged_built
    assert pdf.startswith(b"%PDF-") and pdf.rstrip().endswith(b"%%EOF")
    pages = pdf_pages_text(pdf)
    assert 3 <= len(pages) <= 20
    text = squeeze("\n".join(pages))
    assert squeeze(report.verdict.headline) in text
    for f in findings:
        assert squeeze(f.summary) in text, f.kind
        assert squeeze(f.advice) in text, f.kind
    for title in ("Findings", "Overview", "Appendix", "What the trace holds", "Parameters", "Modules",
                  "Gradient norm per layer and step"):
        assert squeeze(title) in text
    for fact in report.facts:
        assert squeeze(fact.value) in text
    for i in range(len(pages)):  # every page's footer reads (its font is set on every page)
        assert f"torchautopsy report: {report.run_dir}" in _raw_text(pdf, i)
        assert f"page {i + 1} of {len(pages)}" in _raw_text(pdf, i)


def test_pages_render_and_none_is_blank(diverged_built, hostile_built, pdftoppm, tmp_path):
    for name, built in (("diverged", diverged_built), ("hostile", hostile_built)):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "report.pdf"
        path.write_bytes(built[4])
        pngs = render_pdf_pages(pdftoppm, path, tmp_path / name)
        assert len(pngs) == len(pdf_pages_text(path.read_bytes()))
        for png in pngs:
            assert pixel_spread(png.read_bytes()) > 2, (name, png.name)  # something drawn: blank is 0


def test_names_from_the_trace_print_as_text(hostile_built):
    pdf = hostile_built[4]
    param = f"{HOSTILE_IMG}.weight"
    text = "\n".join(pdf_pages_text(pdf))
    for name in (HOSTILE_SCRIPT, param, f"Net{HOSTILE_SCRIPT}", "слой"):
        assert squeeze(name) in squeeze(text), name
    assert squeeze(HOSTILE_LONG) in squeeze(text)  # a name wider than its column wraps, all of it kept
    assert "{nb}" in HOSTILE_UNICODE and squeeze("_{nb}") in squeeze(text)  # never taken for a page count


def test_healthy_pdf_says_no_problem(healthy):
    text = squeeze("\n".join(pdf_pages_text(render_pdf(healthy, []))))
    assert squeeze("No problem found") in text
    assert squeeze("Findings (0)") in text


def _raw_text(pdf: bytes, page: int) -> str:
    import io

    from pypdf import PdfReader

    return PdfReader(io.BytesIO(pdf)).pages[page].extract_text()


def test_a_captions_height_bound_is_never_below_its_height():
    """A figure's page break looks at the caption's exact height only where a cheap bound leaves
    it in doubt (pdf_doc._height_at_most): the bound must never be below the height."""
    from torchautopsy.reports.pdf_doc import PdfDoc

    doc = PdfDoc("t", "v")
    doc.add_page()
    words = "the gradient norm of each layer per step, with the steps of the findings marked".split()
    for caption in ["", "one line", " ".join(words * 9), "\n".join([" ".join(words * 2)] * 3),
                    " ".join(words * 3 + [HOSTILE_LONG[:60]] + words), "a " * 300, "x" * 400]:
        bound = doc._height_at_most(caption, 7.8)
        assert bound is None or bound >= doc._height(caption, 7.8), caption[:40]
