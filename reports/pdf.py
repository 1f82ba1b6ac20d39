"""The PDF report: the same content as the HTML (one built Report), paginated on A4.

Laid out with fpdf2, a pure-Python PDF library (no system libraries: ``pip install`` is enough on
any laptop). Text is set in DejaVu Sans / Sans Mono, the fonts matplotlib ships (so no font has
to be installed, and names in any Latin, Greek or Cyrillic script print; a character these fonts
lack, CJK or an emoji, prints as "?"). Every string from the trace is written as plain text (no
markup is parsed), so a module named ``<script>`` prints as those characters. Figures are the
report's PNGs placed at the size they were drawn (7 inches, 8-point text): readable at 100%.
"""

from __future__ import annotations

import io
import os

import matplotlib
from fpdf import FPDF
from fpdf.enums import MethodReturnValue, TableBordersLayout, XPos, YPos
from fpdf.fonts import FontFace

from ..analyzer.findings import Finding
from ..analyzer.trace import Trace
from .build import build_report
from .format import map_strings, shorten
from .model import EvidenceRow, Figure, Report, Table, Text

MARGIN = 15.0  # mm
_FONT_DIR = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
_FONTS = {("sans", ""): "DejaVuSans.ttf", ("sans", "B"): "DejaVuSans-Bold.ttf",
          ("sans", "I"): "DejaVuSans-Oblique.ttf", ("mono", ""): "DejaVuSansMono.ttf",
          ("mono", "B"): "DejaVuSansMono-Bold.ttf"}
_RGB = {"error": (183, 28, 28), "warning": (180, 83, 9), "info": (21, 101, 192), "ok": (46, 125, 50)}
_MUTED = (85, 85, 85)


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
    pdf.footers()
    return bytes(pdf.output())


class _Doc(FPDF):
    def __init__(self, report: Report):
        super().__init__(orientation="P", unit="mm", format="A4")
        self.r = report
        for (family, style), fname in _FONTS.items():
            self.add_font(family, style, os.path.join(_FONT_DIR, fname))
        # No text is substituted by fpdf2's page-count alias: a name from the trace may spell
        # "{nb}". The footers are written last, when the number of pages is known.
        self.alias_nb_pages(None)
        # Characters every font of the document can draw: any other prints as "?" (fpdf2 would
        # leave a blank and log a warning for each font).
        self._drawable = set.intersection(*(set(f.cmap) for f in self.fonts.values())) | {10, 13}
        self.set_margins(MARGIN, MARGIN, MARGIN)
        self.set_auto_page_break(True, margin=16)
        self.set_title(shorten(report.title, 200))
        self.set_creator(f"torchautopsy {report.version}")
        self.set_author("torchautopsy")

    def drawable(self, text: str) -> str:
        """``text`` with each character the fonts lack replaced by "?"."""
        if all(ord(c) in self._drawable for c in text):
            return text
        return "".join(c if ord(c) in self._drawable else "?" for c in text)

    # -- page furniture ---------------------------------------------------------------------------
    def footers(self) -> None:
        """``title … page N of M`` at the foot of every page, once M is known."""
        last = self.page
        self.set_auto_page_break(False)
        for n in range(1, last + 1):
            self.page = n
            self.set_xy(MARGIN, self.h - 11)
            # fpdf2 writes a font change only when the font differs from the last one set, which
            # was on the last page: set another first, so this page's stream gets its own.
            self.set_font("mono", "", 1)
            self._font("sans", "", 7.5, _MUTED)
            self.cell(self.epw * 0.8, 5, shorten(self.r.title, 110))
            self.cell(self.epw * 0.2, 5, f"page {n} of {last}", align="R")
        self.page = last

    def _font(self, family: str = "sans", style: str = "", size: float = 9.5, color=(26, 26, 26)) -> None:
        self.set_font(family, style, size)
        self.set_text_color(*color)

    def _text(self, text: str, size: float = 9.5, style: str = "", color=(26, 26, 26), family="sans",
              h: float | None = None, gap: float = 1.2) -> None:
        self._font(family, style, size, color)
        self.multi_cell(0, h or size * 0.48, text, align="L", new_x=XPos.LMARGIN, new_y=YPos.NEXT)
        self.ln(gap)

    def _height(self, text: str, size: float, family: str = "sans", h: float | None = None) -> float:
        """The height ``_text`` would take, in mm."""
        self._font(family, "", size)
        return float(self.multi_cell(0, h or size * 0.48, text, align="L", dry_run=True,
                                     output=MethodReturnValue.HEIGHT))

    def _spans(self, text: Text, size: float = 10) -> None:
        """Running text with names in the mono font, wrapped as one paragraph."""
        h = size * 0.5
        for s in text:
            self._font("mono" if s.code else "sans", "", size * (0.93 if s.code else 1.0))
            self.write(h, s.text)
        self.ln(h)

    def _heading(self, text: str, level: int, room: float = 30) -> None:
        """A heading, kept with at least ``room`` mm of what follows it."""
        if self.will_page_break(room):
            self.add_page()
        size = {0: 17, 1: 14, 2: 11.5, 3: 8}[level]
        if level <= 2:
            self.start_section(shorten(text, 120), level=max(0, level - 1))
        self.ln({0: 0, 1: 3, 2: 2, 3: 1.5}[level])
        if level == 3:
            self._text(text.upper(), size=size, style="B", color=_MUTED, gap=0.5)
        else:
            self._text(text, size=size, style="B", gap=1.5)
        if level == 1:
            self.set_draw_color(208, 212, 218)
            self.line(MARGIN, self.get_y() - 0.5, self.w - MARGIN, self.get_y() - 0.5)
            self.ln(2)

    def _badge(self, severity: str, h: float = 5) -> None:
        self.set_fill_color(*_RGB.get(severity, _MUTED))
        self._font("sans", "B", 7.5, (255, 255, 255))
        self.cell(19, h, severity.upper(), align="C", fill=True)
        self.cell(2, h, "")
        self.set_fill_color(255, 255, 255)

    # -- header and verdict -----------------------------------------------------------------------
    def header_page(self) -> None:
        """The first page: the run in one line, the verdict with its fix and figure, the findings."""
        self.add_page()
        self._heading("torchautopsy report", 0)
        self._text(self.r.run_dir, size=8.5, color=_MUTED, family="mono")
        self._text(self.r.run_line, size=9.5)
        for f in self.r.facts:
            if f.bad and f.first_screen:
                self._text(f"{f.label}: {f.value}", size=9.5, style="B", color=_RGB["error"])
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
                row.cell(f.severity.upper(), style=FontFace(emphasis="B", color=_RGB.get(f.severity, _MUTED)))
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
                row.cell(label, style=FontFace(emphasis="B", color=_MUTED))
                row.cell(value, style=FontFace(emphasis="B", color=_RGB["error"]) if bad else None)
        self.ln(4)

    def _verdict(self) -> None:
        v = self.r.verdict
        color = _RGB.get(v.severity, _RGB["ok"])
        top, page = self.get_y(), self.page_no()
        self.set_left_margin(MARGIN + 5)
        self.set_x(MARGIN + 5)
        self.ln(1)
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
        bottom = self.get_y()
        self.set_left_margin(MARGIN)
        if self.page_no() == page:
            self.set_fill_color(*color)
            self.rect(MARGIN, top, 2.2, bottom - top, style="F")
            self.set_fill_color(255, 255, 255)
        self.ln(4)
        if v.figure is not None:
            self._figure(v.figure)

    # -- findings ---------------------------------------------------------------------------------
    def findings(self) -> None:
        r = self.r
        n = len(r.findings) + (len(r.more_findings.rows) if r.more_findings else 0)
        self._heading(f"Findings ({n})", 1, room=80)
        if not r.findings:
            self._text("None: the checks above found nothing to report.", color=_MUTED)
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

    # -- figures and tables -----------------------------------------------------------------------
    def _figure_size(self, fig: Figure) -> tuple[float, float]:
        """The width and height a figure is placed at, in mm: as drawn, or the page's width."""
        w, h = fig.width_in * 25.4, fig.height_in * 25.4
        return (self.epw, h * self.epw / w) if w > self.epw else (w, h)

    def _figure(self, fig: Figure) -> None:
        caption_h = self._height(fig.caption, 7.8) + 3
        if fig.png:
            w, h = self._figure_size(fig)
            if self.will_page_break(h + caption_h + (6 if fig.title else 0)):
                self.add_page()
        if fig.title:
            self._text(fig.title, size=9.5, style="B", gap=0.8)
        if fig.png:
            self.image(io.BytesIO(fig.png), x=MARGIN + (self.epw - w) / 2, w=w, h=h, alt_text=fig.title)
            self.ln(1)
        self._text(fig.caption, size=7.8, color=_MUTED, gap=3)

    def _table(self, t: Table) -> None:
        self._heading(t.title, 2, room=30)
        self._text(t.caption, size=8, color=_MUTED)
        if t.rows:
            widths = t.widths or (1,) * len(t.columns)
            aligns = tuple("RIGHT" if num else "LEFT" for num in t.numeric)
            self._font("sans", "", 7)
            with self.table(col_widths=widths, text_align=aligns, line_height=3.3,
                            borders_layout=TableBordersLayout.HORIZONTAL_LINES, padding=(0.4, 0.8),
                            headings_style=FontFace(emphasis="B", color=(51, 51, 51), fill_color=(238, 240, 243)),
                            ) as table:
                header = table.row()
                for c in t.columns:
                    header.cell(c)
                for values in t.rows:
                    row = table.row()
                    for i, v in enumerate(values):
                        row.cell(v, style=FontFace(family="mono", size_pt=6.8) if i == 0 else None)
        if t.more:
            self.ln(1)
            self._text(t.more, size=8, color=_MUTED)
        self.ln(3)

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
                row.cell("✓" if ok else "✗", style=FontFace(emphasis="B", color=_RGB["ok"] if ok else _RGB["error"]))
                row.cell(item.what, style=FontFace(emphasis="B", color=(26, 26, 26) if ok else _MUTED))
                row.cell(item.detail, style=None if ok else FontFace(color=_MUTED))
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
