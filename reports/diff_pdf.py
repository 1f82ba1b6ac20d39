"""`diff --pdf`: the content of diff's HTML report paginated on A4, laid out as analyze's PDF is
(pdf_doc.py's fonts, text cleaning and page furniture): the two runs, the verdict, diff_figures.py's
figures (the same PNGs the HTML inlines), the setup differences as a table (setting, A, B), then the
findings new in B and those only in A. Every string passes format.bounded (printable, cut to what a
page can lay out) and the fonts' drawable characters, as in analyze's PDF: names come from traces."""

from __future__ import annotations

from dataclasses import dataclass

from .. import __version__
from ..analyzer.diff import DiffResult
from .diff_figures import diff_figures
from .diff_report import new_finding_lines, setup_rows
from .format import bounded, map_strings
from .model import Figure, Span, Table, Text
from .pdf_doc import MUTED, RGB, PdfDoc

# Setup rows laid out; the rest are counted. Most runs differ in a handful, but a model made wider
# differs in every parameter's shape, and fpdf2 lays out tables at a few ms a row. --json has all.
SETUP_ROWS = 300


@dataclass(frozen=True)
class _View:
    """What the PDF shows, as plain strings (so format.map_strings can clean every one)."""

    title: str
    runs: tuple[Text, ...]
    verdict: str
    parted: bool
    figures: list[Figure]
    setup: Table | None  # None: no difference recorded
    new_b: list[str]
    new_a: list[str]


def render_diff_pdf(r: DiffResult, a_dir: str, b_dir: str, figures: list[Figure] | None = None) -> bytes:
    """The PDF; ``figures``: diff_figures(r), when the caller drew them already (for the HTML too)."""
    view = bounded(_view(r, a_dir, b_dir, diff_figures(r) if figures is None else figures))
    pdf = _DiffDoc(view.title)
    v = map_strings(view, lambda text, _: pdf.drawable(text))
    pdf.first_page(v)
    pdf.figures(v.figures)
    pdf.setup(v.setup)
    pdf.new_findings(v.new_b, v.new_a)
    pdf.footers(v.title)
    return bytes(pdf.output())


def _view(r: DiffResult, a_dir: str, b_dir: str, figures: list[Figure]) -> _View:
    runs = tuple((Span(f"{label}: "), Span(path, code=True), Span(f", rank {rt.rank}, {rt.n_steps:,} steps"))
                 for label, path, rt in (("A (reference)", a_dir, r.a), ("B (suspect)", b_dir, r.b)))
    rows = setup_rows(r)
    setup = None
    if rows:
        more = len(rows) - SETUP_ROWS
        setup = Table(title=f"What differs, A → B ({len(rows):,})",
                      caption="Only values both traces recorded are compared; nothing is guessed.",
                      columns=("setting", "A (reference)", "B (suspect)"), rows=rows[:SETUP_ROWS],
                      numeric=(False, False, False), widths=(36, 32, 32),
                      more=f"{more:,} more differences: diff --json lists them all." if more > 0 else "")
    return _View(title=f"torchautopsy diff: {b_dir} against {a_dir}", runs=runs, verdict=r.verdict(),
                 parted=r.parted is not None, figures=figures, setup=setup,
                 new_b=new_finding_lines(r, "b"), new_a=new_finding_lines(r, "a"))


class _DiffDoc(PdfDoc):
    def __init__(self, title: str):
        super().__init__(title, __version__)

    def first_page(self, v: _View) -> None:
        """The runs compared, then the verdict in a box: red when B parts, green when it does not."""
        self.add_page()
        self._heading("torchautopsy diff", 0)
        for line in v.runs:
            self._spans(line, size=9.5)
            self.ln(0.8)
        self.ln(3)
        with self._side_bar(RGB["error"] if v.parted else RGB["ok"]):
            self._text(v.verdict, size=11.5, style="B", h=6, gap=1)

    def figures(self, figures: list[Figure]) -> None:
        for fig in figures:
            self._figure(fig)

    def setup(self, table: Table | None) -> None:
        self._heading("Setup", 1)
        if table is None:
            self._text("No difference recorded in the setup.", color=MUTED)
        else:
            self._table(table)

    def new_findings(self, new_b: list[str], new_a: list[str]) -> None:
        if not (new_b or new_a):
            return
        self._heading("Findings only one run has", 1)
        for label, lines in (("New in B", new_b), ("Only in A", new_a)):
            if lines:
                self._heading(label, 2, room=15)
                for line in lines:
                    self._text(f"• {line}", size=9.5, gap=1.5)
