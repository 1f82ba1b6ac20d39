"""What a report holds, as plain data: built once from a trace (build.py), then rendered as HTML
(html.py) and PDF (pdf.py). Nothing here is markup: every string is text to be escaped by the
renderer, and every figure is a PNG drawn once and shared by both formats.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A piece of running text; ``code`` marks a name from the trace (a module, a parameter)."""

    text: str
    code: bool = False


Text = tuple[Span, ...]


def plain(text: Text) -> str:
    return "".join(s.text for s in text)


@dataclass(frozen=True)
class Figure:
    title: str
    caption: str
    png: bytes | None  # None when there was nothing to draw; the caption says why
    width_in: float = 0.0  # the size it was drawn at: the PDF places it at exactly this size
    height_in: float = 0.0


@dataclass(frozen=True)
class Fact:
    label: str
    value: str
    bad: bool = False  # a fact the reader should not miss (a killed job, unreadable ranks)
    first_screen: bool = True  # a bad fact is also said under the run line (unless that line says it)


# An evidence row: (key, text) or, for a nested dict, (key, rows again).
EvidenceRow = tuple[str, "str | list[EvidenceRow]"]


@dataclass(frozen=True)
class FindingView:
    anchor: str  # HTML id and PDF link target: "finding-1", ...
    kind: str
    severity: str
    step: int | None
    rank: int | None
    where: tuple[str, ...]  # names as the trace spells them ("" -> "(the model itself)")
    where_more: int  # names not listed (a finding may name thousands of parameters)
    code: tuple[str, ...]  # where each name's code is ("" if not known): evidence["code"]
    summary: str
    evidence: list[EvidenceRow]
    advice: str
    figure: Figure | None


@dataclass(frozen=True)
class Table:
    title: str
    caption: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    numeric: tuple[bool, ...]  # right-align these columns
    more: str = ""  # "1,234 more parameters not shown", when the table was cut
    widths: tuple[float, ...] = ()  # relative column widths for the PDF (empty: equal)


@dataclass(frozen=True)
class Recorded:
    what: str
    recorded: bool
    detail: str


@dataclass(frozen=True)
class Verdict:
    severity: str  # "error" | "warning" | "ok" (no warning or error)
    headline: str
    sentences: tuple[Text, ...]  # the first thing that went wrong, then the chain after it
    checked: tuple[str, ...]
    n_problems: int
    n_notes: int
    first_anchor: str | None  # the finding the chain starts with
    fix: str = ""  # the first finding's advice, its first sentence: what to do first
    figure: "Figure | None" = None  # the first finding's figure, shown with the verdict
    not_checked: str = ""  # one line: the detectors that could not judge the trace, and what each lacks


@dataclass(frozen=True)
class Report:
    title: str
    run_dir: str
    version: str
    run_line: str  # model, steps, ranks, how it ended; optimizer and learning rate: one line
    facts: list[Fact]  # the run's details (appendix; the bad ones also under the verdict)
    settings: list[tuple[str, str]]  # recorder settings, name -> value
    verdict: Verdict
    findings: list[FindingView]  # shown in full, most severe first, then by step
    more_findings: Table | None  # the rest, one line each, when there are too many to show in full
    overview: list[Figure]
    tables: list[Table]  # appendix: last recorded statistics per layer
    recorded: list[Recorded]  # appendix: what the trace holds and what it does not
    model_summary: str
    ranks: tuple = ()  # figures of the ranks side by side (a many-rank run; ranks.py)
    rank_table: Table | None = None  # how each rank's trace ends, when some did not close
