"""Names and texts from a trace, cut to a size a terminal line, a table cell or a page can hold.

A trace is untrusted: a module name or model class may be 100,000 characters long. Every output
(the CLI's lines, the HTML, the PDF, the Markdown) shows such strings through these functions;
the JSON findings keep names exactly as the trace spells them. Plain text in, plain text out
(control characters escaped, lone surrogates replaced: ``printable``): each renderer still
escapes the result for its own format.
"""

from __future__ import annotations

import re

from .trace.format import clean_text

# A name on a terminal line or in a Markdown cell; the model class, a title.
NAME_CHARS = 100
TITLE_CHARS = 160
# A name in a report's table or page: long real names (deep module paths) still show whole.
REPORT_NAME_CHARS = 200
# Running text (a summary, a caption): its longest unbroken run of characters, and its length.
WORD_CHARS = REPORT_NAME_CHARS
TEXT_CHARS = 2000

ELLIPSIS = "…"


_SURROGATE = re.compile("[\ud800-\udfff]")


def printable(text) -> str:
    """``text`` as every output can carry it: control characters escaped (trace/format.py's
    clean_text: no terminal escape or title sequence gets through), and lone surrogates (a JSON
    text's "\\ud800", a run directory named in bytes that are not UTF-8) replaced by U+FFFD, which
    UTF-8 and a PDF's fonts cannot encode."""
    text = clean_text(str(text))
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def shorten(text, width: int = NAME_CHARS) -> str:
    """``text`` cut in the middle to ``width`` characters: module paths keep their start and
    their end (``model.layers.31.…mlp.down_proj``), where they differ most."""
    text = printable(text)
    if len(text) <= width:
        return text
    width = max(width, 3)
    head = (width - 1) // 2
    return text[:head] + ELLIPSIS + text[len(text) - (width - 1 - head):]


def shorten_words(text, word: int = WORD_CHARS, width: int = TEXT_CHARS) -> str:
    """Running text with every unbroken run longer than ``word`` (a name inside a sentence) cut
    in the middle, then the whole cut to ``width`` (its middle left out where words meet, see
    ``_cut_text``). Line breaks and spaces are kept."""
    text = printable(text)
    if len(text) > 4 * width:  # no need to scan a huge text whole: its middle is cut anyway
        text = shorten(text, 4 * width)
    text = re.sub(r"\S{%d,}" % (word + 1), lambda m: shorten(m.group(), word), text)
    return _cut_text(text, width)


def _cut_text(text: str, width: int) -> str:
    """Running text longer than ``width``: its start and its end, at most ``width`` characters,
    the middle replaced by `` … `` between two words; a word is cut (next to the ellipsis) only
    where no space is near enough (a quarter of ``width``)."""
    if len(text) <= width:
        return text
    if width < 8:
        return shorten(text, width)
    head_n = (width - 3) // 2
    tail_n = width - 3 - head_n
    head, tail = text[:head_n], text[len(text) - tail_n:]
    reach = max(head_n // 2, 1)
    if not text[head_n].isspace():  # the head ends inside a word: end it at the space before
        space = max(head.rfind(" "), head.rfind("\n"))
        if space >= head_n - reach and space > 0:
            head = head[:space]
    if not text[len(text) - tail_n - 1].isspace():  # the tail starts inside a word
        found = re.search(r"\s", tail[:reach])
        if found:
            tail = tail[found.start():]
    head, tail = head.rstrip(), tail.lstrip()
    left = " " if text[len(head)].isspace() else ""  # head and tail are still a prefix and a suffix
    right = " " if text[len(text) - len(tail) - 1].isspace() else ""
    return f"{head}{left}{ELLIPSIS}{right}{tail}"


def listed(names, shown: int) -> str:
    """The first ``shown`` names, comma-separated ("" as "(model)"), and how many more there are."""
    names = list(names)
    text = ", ".join(n or "(model)" for n in names[:shown])
    return text + (f" and {len(names) - shown:,} more" if len(names) > shown else "")


def ordinal(n: int) -> str:
    """first, second, third, 4th, ...: the n-th call of a module named in a sentence."""
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")
