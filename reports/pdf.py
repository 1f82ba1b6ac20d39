"""The PDF report: the same content as the HTML (one built Report), paginated on A4. The fonts,
text cleaning and page furniture are pdf_doc.py's (shared with diff's PDF).
"""

from __future__ import annotations

from fpdf.enums import TableBordersLayout, XPos, YPos
from fpdf.fonts import FontFace

from ..analyzer.findings import Finding
from ..analyzer.trace import Trace
from .build import build_report
from .format import map_strings, shorten
from .model import EvidenceRow, Report
from .pdf_doc import MARGIN, MUTED, RGB, PdfDoc


def render_pdf(report_or_trace: Report | Trace, findings: list[Finding] | None = None) -> bytes:
    """The PDF of a built report, or of ``trace`` and its ``findings`` (built here)."""
    report = report_or_trace if isinstance(report_or_trace, Report) else build_report(report_or_trace, findings or [])
    pdf = _Doc(report)
    pdf.r = map_strings(report, lambda text, _: pdf.drawable(text))
    pdf.header_page()
    pdf.findings()
    pdf.ranks()
    pdf.overview()
    pdf.appendix()
    pdf.footers(pdf.r.title)
    return bytes(pdf.output())


class _Doc(PdfDoc):
    def __init__(self, report: Report):
        super().__init__(report.title, report.version)
        self.r = report

    # -- header and verdict -----------------------------------------------------------------------
    def header_page(self) -> None:
        """The first page: the run in one line, the verdict with its fix and figure, the findings."""
        self.add_page()
        self._heading("torchautopsy report", 0)
        self._text(self.r.run_dir, size=8.5, color=MUTED, family="mono")
        self._text(self.r.run_line, size=9.5)
        for f in self.r.facts:
            if f.bad and f.first_screen:
                self._text(f"{f.label}: {f.value}", size=9.5, style="B", color=RGB["error"])
        self.ln(3)
        self._verdict()
        self._finding_list()

    def _finding_list(self) -> None:
        if not self.r.findings:
            return
        self._font("sans", "", 8.5)
        with self.table(col_widths=(12, 28, 16, 44), first_row_as_headings=False, text_align="LEFT",
                        borders_layout=TableBordersLayout.HORIZONTAL_LINES, line_height=4.2,
                        padding=(0.6, 1, 0.6, 0)) as table:
            for f in self.r.findings:
                row = table.row()
                row.cell(f.severity.upper(), style=FontFace(emphasis="B", color=RGB.get(f.severity, MUTED)))
                row.cell(f.kind)
                row.cell(("" if f.step is None else f"step {f.step:,}") + ("" if f.rank is None else f" · rank {f.rank}"))
                where = (f.where[0] or "(model)") if f.where else ""
                more = len(f.where) - 1 + f.where_more if f.where else 0
                row.cell(where + (f" +{more}" if more > 0 else ""))
        self.ln(4)

    def run_table(self) -> None:
        """The appendix's table of the run: its facts and the recorder's settings."""
        rows = [(f.label, f.value, f.bad) for f in self.r.facts]
        if self.r.settings:
            rows.append(("Recorder settings", ", ".join(f"{k}={v}" for k, v in self.r.settings), False))
        self._font("sans", "", 8.5)
        with self.table(col_widths=(22, 78), first_row_as_headings=False, text_align="LEFT",
                        borders_layout=TableBordersLayout.HORIZONTAL_LINES, line_height=4.2,
                        padding=(0.6, 1, 0.6, 0)) as table:
            for label, value, bad in rows:
                row = table.row()
                row.cell(label, style=FontFace(emphasis="B", color=MUTED))
                row.cell(value, style=FontFace(emphasis="B", color=RGB["error"]) if bad else None)
        self.ln(4)

    def _verdict(self) -> None:
        v = self.r.verdict
        with self._side_bar(RGB.get(v.severity, RGB["ok"])):
            if v.severity != "ok":
                self._badge(v.severity, h=6)
            self._font("sans", "B", 11.5)
            self.multi_cell(0, 6, v.headline, align="L", new_x=XPos.LMARGIN, new_y=YPos.NEXT)
            self.ln(1)
            for sentence in v.sentences:
                self._spans(sentence, size=10)
                self.ln(1.2)
            if v.fix:
                self._text(f"Fix first: {v.fix}", size=10, style="B")
            if v.severity == "ok":
                self._text(f"Checked: {', '.join(v.checked)}." + (f" {v.n_notes} note(s) below." if v.n_notes else ""),
                           size=10)
            if v.not_checked:
                self._text(v.not_checked, size=10)
        if v.figure is not None:
            self._figure(v.figure)

    # -- findings ---------------------------------------------------------------------------------
    def findings(self) -> None:
        r = self.r
        n = len(r.findings) + (len(r.more_findings.rows) if r.more_findings else 0)
        self._heading(f"Findings ({n})", 1, room=80)
        if not r.findings:
            self._text("None: the checks above found nothing to report.", color=MUTED)
        for f in r.findings:
            self._heading_finding(f)
            if f.where:
                self._font("sans", "", 9)
                self.write(4.6, "Where: ")
                for i, w in enumerate(f.where):
                    self._font("mono", "", 8.5)
                    self.write(4.6, w or "(the model itself)")
                    if f.code and f.code[i]:
                        self._font("sans", "", 9)
                        self.write(4.6, f" ({f.code[i]})")
                    if i < len(f.where) - 1:
                        self._font("sans", "", 9)
                        self.write(4.6, ", ")
                if f.where_more:
                    self._font("sans", "", 9)
                    self.write(4.6, f" and {f.where_more} more")
                self.ln(6)
            self._text(f.summary, size=9.5)
            if f.figure:
                self._figure(f.figure)
            if f.advice:
                self._heading("Advice", 3, room=14)
                self._text(f.advice, size=9.5)
            if f.evidence:
                # A short evidence table is not split: a few rows alone on the next page read badly.
                need = 12 + self._kv_height(f.evidence)
                if self.will_page_break(need) and need < 0.5 * (self.h - 2 * MARGIN):
                    self.add_page()
                self._heading("Evidence", 3, room=14)
                self._kv(f.evidence)
            self.ln(4)
            self.set_draw_color(208, 212, 218)
            self.line(MARGIN, self.get_y(), self.w - MARGIN, self.get_y())
            self.ln(2)
        if r.more_findings:
            self._table(r.more_findings)

    def _heading_finding(self, f) -> None:
        # The title, the summary and the figure on one page when they fit on one: a title left
        # at the foot of a page with its figure on the next reads as two findings.
        need = 24 + self._height(f.summary, 9.5)
        if f.figure is not None and f.figure.png:
            need += self._figure_size(f.figure)[1] + self._height(f.figure.caption, 7.8) + 9
        if self.will_page_break(min(need, self.eph - 10) if need < self.eph else 60):
            self.add_page()
        title = f"{f.kind}" + (f" at step {f.step:,}" if f.step is not None else "")
        self.start_section(shorten(f"{f.severity}: {title}", 120), level=1)
        self.ln(2)
        self._badge(f.severity, h=6)
        self._font("sans", "B", 12)
        self.cell(0, 6, title + (f"  ·  rank {f.rank}" if f.rank is not None else ""),
                  new_x=XPos.LMARGIN, new_y=YPos.NEXT)
        self.ln(1.5)

    def _kv_height(self, rows: list[EvidenceRow]) -> float:
        """About how tall _kv draws ``rows``, in mm (wrapped lines counted: ~70 mono characters
        fit on a line of the value column, ~45 of the key column)."""
        return sum(3.6 * max(1, -(-len(value) // 70), -(-len(key) // 45)) + 0.9 for key, value in _flatten(rows))

    def _kv(self, rows: list[EvidenceRow]) -> None:
        flat = list(_flatten(rows))
        self._font("mono", "", 7.5)
        with self.table(col_widths=(38, 62), first_row_as_headings=False, text_align="LEFT",
                        borders_layout=TableBordersLayout.HORIZONTAL_LINES, line_height=3.6,
                        padding=(0.4, 1, 0.4, 0)) as table:
            for key, value in flat:
                row = table.row()
                row.cell(key, style=FontFace(family="sans", size_pt=7.5, color=(51, 51, 51)))
                row.cell(value)

    # -- overview and appendix --------------------------------------------------------------------
    def overview(self) -> None:
        self.add_page()
        self._heading("Overview", 1)
        for fig in self.r.overview:
            self._figure(fig)

    def ranks(self) -> None:
        if not (self.r.ranks or self.r.rank_table):
            return
        self.add_page()
        self._heading("Ranks", 1)
        if self.r.rank_table:
            self._table(self.r.rank_table)
        for fig in self.r.ranks:
            self._figure(fig)

    def appendix(self) -> None:
        r = self.r
        self.add_page()
        self._heading("Appendix", 1)
        self._heading("The run", 2)
        self.run_table()
        self._heading("What the trace holds", 2)
        self._font("sans", "", 8.5)
        with self.table(col_widths=(4, 40, 56), first_row_as_headings=False, text_align="LEFT",
                        borders_layout=TableBordersLayout.HORIZONTAL_LINES, line_height=4,
                        padding=(0.5, 1, 0.5, 0)) as table:
            for item in r.recorded:
                row = table.row()
                ok = item.recorded
                row.cell("✓" if ok else "✗", style=FontFace(emphasis="B", color=RGB["ok"] if ok else RGB["error"]))
                row.cell(item.what, style=FontFace(emphasis="B", color=(26, 26, 26) if ok else MUTED))
                row.cell(item.detail, style=None if ok else FontFace(color=MUTED))
        self.ln(4)
        for t in r.tables:
            self._table(t)
        if r.model_summary:
            height = self._height(r.model_summary, 7, "mono", 3.2)
            if self.will_page_break(height + 12) and height + 12 < self.eph:
                self.add_page()  # a model that fits on a page is not split across two
            self._heading("Model", 2)
            self._text(r.model_summary, size=7, family="mono", h=3.2)


def _flatten(rows: list[EvidenceRow], depth: int = 0):
    """Nested evidence as (indented key, value) lines: the PDF's tables do not nest."""
    for key, value in rows:
        pad = "   " * depth
        if isinstance(value, str):
            yield pad + key, value
        else:
            yield pad + key, ""
            yield from _flatten(value, depth + 1)
