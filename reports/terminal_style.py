"""How the terminal's lines look where they are read: colour, and wrapping at word boundaries.

- Colour only where a person reads it: on when the stream is a terminal, off when it is piped or
  redirected. ``NO_COLOR`` (any non-empty value, https://no-color.org) turns it off, ``FORCE_COLOR``
  (non-empty) turns it on, and ``NO_COLOR`` wins when both are set (as CPython does); ``--color`` /
  ``--no-color`` wins over both. ``TERM=dumb`` turns it off on a terminal. The escape codes come
  from ``click.style`` and only ever reach the stream the report is echoed to, never a file.
- Wrapping only on a terminal: a long line folds at spaces to the terminal's width (``COLUMNS``,
  else the terminal's own size), never inside a word (a name longer than the line stays whole),
  its continuation lines indented under the text they continue. Piped or redirected output is
  not wrapped: one line per fact, for grep and for logs.

``PLAIN`` (no colour, no wrapping) is what the report functions default to.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass

import click

# Narrower terminals than this still get lines of this width (the terminal folds them).
MIN_WIDTH = 20
# A terminal whose size cannot be read.
FALLBACK_WIDTH = 100
SEVERITY_STYLES = {"error": {"fg": "red", "bold": True}, "warning": {"fg": "yellow"}, "info": {"fg": "cyan"}}
# "  label        value": a continuation line starts under the value (the gap ends this early).
_COLUMN = re.compile(r"(\s*)\S.*?\s{2,}(?=\S)")
_COLUMN_END = 24


@dataclass(frozen=True)
class Style:
    """``colour``: whether to add escape codes; ``width``: the width to wrap to, or None (no wrapping)."""

    colour: bool = False
    width: int | None = None

    def paint(self, text: str, **styles) -> str:
        """``text`` with click.style's ``styles`` (fg=..., bold=...), each line on its own; as is without colour."""
        if not self.colour or not styles:
            return text
        return "\n".join(click.style(line, **styles) if line else line for line in text.split("\n"))

    def severity(self, severity: str, text: str) -> str:
        return self.paint(text, **SEVERITY_STYLES.get(severity, {}))

    def verdict(self, text: str, severity: str | None = None) -> str:
        """The verdict: bold, in the colour of the worst severity found (green: nothing wrong)."""
        fg = SEVERITY_STYLES[severity]["fg"] if severity in SEVERITY_STYLES else "green"
        return self.paint(text, bold=True, fg=fg)

    def wrap(self, text: str, hang: int | None = None) -> str:
        """Each line of ``text`` folded at spaces to ``width``; continuation lines indented by
        ``hang`` (default: under the value of a "label   value" line, else two more than the line)."""
        if self.width is None:
            return text
        return "\n".join(self._wrap_line(line, hang) for line in text.split("\n"))

    def _wrap_line(self, line: str, hang: int | None) -> str:
        if len(line) <= self.width:
            return line
        body = line.lstrip(" ")
        lead = len(line) - len(body)
        if hang is None:
            m = _COLUMN.match(line[: _COLUMN_END + 2])
            hang = m.end() if m and m.end() <= _COLUMN_END else lead + (2 if lead < 6 else 0)
        hang = min(hang, self.width // 2)  # a narrow terminal still shows some words per line
        wrapper = textwrap.TextWrapper(width=self.width, initial_indent=" " * lead, subsequent_indent=" " * hang,
                                       break_long_words=False, break_on_hyphens=False)
        return "\n".join(wrapper.wrap(body)) or line


PLAIN = Style()


def _set(name: str) -> bool:
    return bool(os.environ.get(name))


def wants_colour(stream, option: bool | None = None) -> bool:
    """Whether to colour what is written to ``stream``: ``option`` (--color/--no-color) if given,
    else NO_COLOR, FORCE_COLOR, TERM=dumb, then whether the stream is a terminal."""
    if option is not None:
        return option
    if _set("NO_COLOR"):
        return False
    if _set("FORCE_COLOR"):
        return True
    return _isatty(stream) and os.environ.get("TERM") != "dumb"


def terminal_width(stream) -> int | None:
    """The width to wrap to on ``stream``: None unless it is a terminal; then ``COLUMNS``, else the
    terminal's size, else FALLBACK_WIDTH."""
    if not _isatty(stream):
        return None
    width = 0
    try:
        width = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        pass
    if width <= 0:
        try:
            width = os.get_terminal_size(stream.fileno()).columns
        except (AttributeError, ValueError, OSError):
            width = 0
    return max(width, MIN_WIDTH) if width > 0 else FALLBACK_WIDTH


def style_for(stream, colour: bool | None = None) -> Style:
    """The style of lines echoed to ``stream`` (sys.stdout, or sys.stderr when stdout holds an output)."""
    return Style(colour=wants_colour(stream, colour), width=terminal_width(stream))


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
