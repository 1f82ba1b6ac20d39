"""The page furniture both PDF reports share (analyze's, pdf.py; diff's, diff_pdf.py): fonts,
the characters they can draw, headings, running text, figures, tables and page footers.

Laid out with fpdf2, a pure-Python PDF library (no system libraries: ``pip install`` is enough on
any laptop). Text is set in DejaVu Sans / Sans Mono, the fonts matplotlib ships (so no font has
to be installed, and names in any Latin, Greek or Cyrillic script print; a character these fonts
lack, CJK or an emoji, prints as "?"). Every string from the trace is written as plain text (no
markup is parsed), so a module named ``<script>`` prints as those characters. Figures are the
reports' PNGs placed at the size they were drawn (7 inches, 8-point text): readable at 100%.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager

import matplotlib
from fpdf import FPDF
from fpdf.enums import MethodReturnValue, TableBordersLayout, XPos, YPos
from fpdf.fonts import FontFace

from .format import shorten
from .model import Figure, Table, Text

MARGIN = 15.0  # mm
_FONT_DIR = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
_FONTS = {("sans", ""): "DejaVuSans.ttf", ("sans", "B"): "DejaVuSans-Bold.ttf",
          ("sans", "I"): "DejaVuSans-Oblique.ttf", ("mono", ""): "DejaVuSansMono.ttf",
          ("mono", "B"): "DejaVuSansMono-Bold.ttf"}
RGB = {"error": (183, 28, 28), "warning": (180, 83, 9), "info": (21, 101, 192), "ok": (46, 125, 50)}
MUTED = (85, 85, 85)


class PdfDoc(FPDF):
    """An A4 document with the reports' fonts; subclasses lay out their own sections. Strings from
    a trace go through ``drawable`` (or format.map_strings with it) before they are written."""

    def __init__(self, title: str, version: str):
        super().__init__(orientation="P", unit="mm", format="A4")
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
        self.set_title(shorten(title, 200))
        self.set_creator(f"torchautopsy {version}")
        self.set_author("torchautopsy")

    def drawable(self, text: str) -> str:
        """``text`` with each character the fonts lack replaced by "?"."""
        if all(ord(c) in self._drawable for c in text):
            return text
        return "".join(c if ord(c) in self._drawable else "?" for c in text)

    # -- page furniture ---------------------------------------------------------------------------
    def footers(self, title: str) -> None:
        """``title … page N of M`` at the foot of every page, once M is known (``title`` drawable)."""
        last = self.page
        self.set_auto_page_break(False)
        for n in range(1, last + 1):
            self.page = n
            self.set_xy(MARGIN, self.h - 11)
            # fpdf2 writes a font change only when the font differs from the last one set, which
            # was on the last page: set another first, so this page's stream gets its own.
            self.set_font("mono", "", 1)
            self._font("sans", "", 7.5, MUTED)
            self.cell(self.epw * 0.8, 5, shorten(title, 110))
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
            self._text(text.upper(), size=size, style="B", color=MUTED, gap=0.5)
        else:
            self._text(text, size=size, style="B", gap=1.5)
        if level == 1:
            self.set_draw_color(208, 212, 218)
            self.line(MARGIN, self.get_y() - 0.5, self.w - MARGIN, self.get_y() - 0.5)
            self.ln(2)

    def _badge(self, severity: str, h: float = 5) -> None:
        self.set_fill_color(*RGB.get(severity, MUTED))
        self._font("sans", "B", 7.5, (255, 255, 255))
        self.cell(19, h, severity.upper(), align="C", fill=True)
        self.cell(2, h, "")
        self.set_fill_color(255, 255, 255)

    @contextmanager
    def _side_bar(self, color):
        """What is written inside, indented, with a bar of ``color`` down its left: the verdict's
        box (no bar when it ran onto the next page: half a bar reads as a layout fault)."""
        top, page = self.get_y(), self.page_no()
        self.set_left_margin(MARGIN + 5)
        self.set_x(MARGIN + 5)
        self.ln(1)
        yield
        bottom = self.get_y()
        self.set_left_margin(MARGIN)
        if self.page_no() == page:
            self.set_fill_color(*color)
            self.rect(MARGIN, top, 2.2, bottom - top, style="F")
            self.set_fill_color(255, 255, 255)
        self.ln(4)

    # -- figures and tables -----------------------------------------------------------------------
    def _figure_size(self, fig: Figure) -> tuple[float, float]:
        """The width and height a figure is placed at, in mm: as drawn, or the page's width."""
        w, h = fig.width_in * 25.4, fig.height_in * 25.4
        return (self.epw, h * self.epw / w) if w > self.epw else (w, h)

    def _height_at_most(self, text: str, size: float) -> float | None:
        """A bound on the height ``_text`` would take, in mm, from the widths of ``text`` and its
        longest word alone (linear, where fpdf2's line breaking is quadratic in a line's length);
        None where words are too long for it to be tight. Every wrapped line is filled to within
        a space and a word of the width, so a paragraph takes at most width / (that) + 1 lines
        (one line more kept for rounding)."""
        self._font("sans", "", size)
        room = self.w - self.r_margin - self.x - 2 * self.c_margin
        slack = room - self.get_string_width(" ") - max(map(self.get_string_width, text.split() or [""]))
        if slack < room / 2:
            return None
        lines = sum(int(self.get_string_width(p) / slack) + 1 for p in text.split("\n")) + 1
        return lines * size * 0.48

    def _figure(self, fig: Figure) -> None:
        if fig.png:
            w, h = self._figure_size(fig)
            # The exact caption's height (a dry run of its line breaking) only where the bound
            # does not already show that the figure and caption fit on this page.
            title_h = 6 if fig.title else 0
            bound = self._height_at_most(fig.caption, 7.8)
            if bound is None or self.will_page_break(h + bound + 3 + title_h):
                if self.will_page_break(h + self._height(fig.caption, 7.8) + 3 + title_h):
                    self.add_page()
        if fig.title:
            self._text(fig.title, size=9.5, style="B", gap=0.8)
        if fig.png:
            self.image(io.BytesIO(fig.png), x=MARGIN + (self.epw - w) / 2, w=w, h=h, alt_text=fig.title)
            self.ln(1)
        self._text(fig.caption, size=7.8, color=MUTED, gap=3)

    def _table(self, t: Table) -> None:
        self._heading(t.title, 2, room=30)
        self._text(t.caption, size=8, color=MUTED)
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
            self._text(t.more, size=8, color=MUTED)
        self.ln(3)
