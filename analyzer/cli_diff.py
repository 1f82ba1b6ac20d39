"""``torchautopsy diff RUN_A RUN_B``: where and when B parts from A, and what in their setup
differs (analyzer/diff/). Registered on the command group of cli.py, whose conventions it keeps:
one line and exit code 2 for unusable input, '-' for --json or --md writes it to stdout (never
for --html or --pdf), every output follows output.py's rule; exit 1 under ``--fail-on parted``
when B parts from A."""

from __future__ import annotations

import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import click

from .cli import _dash_outputs, _echo_to, _load, _rank_files, cli
from .cluster import SCHEDULER_HELP, scheduler_for
from .diff import diff_runs, new_findings, pick_rank
from .output import check_outputs, write_output, write_stdout
from .parallel import WORKERS_FROM_BYTES, files_bytes, workers_for
from .run import analyze as run_detectors
from .trace import Trace, safety
from .trace.run_dir import load_files


@cli.command(short_help="Compare run B with run A (the one that worked): where B parts, what differs.")
@click.argument("run_a", type=click.Path())
@click.argument("run_b", type=click.Path())
@click.option("--rank", type=int, default=None,
              help="Which rank of each (default: the only one; runs of several ranks: the lowest both hold).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write the comparison as JSON (identical, parted, setup, new_findings). '-': to stdout.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Write a self-contained HTML report (A and B overlaid, the parting marked, the setup).")
@click.option("--pdf", "pdf_path", type=click.Path(dir_okay=False),
              help="Write the same report as a paginated PDF (A4): the verdict, the figures, the setup, "
                   "the new findings.")
@click.option("--md", "md_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write a Markdown report to paste into a ticket. '-': to stdout.")
@click.option("--fail-on", type=click.Choice(["parted", "none"]), default="none", show_default=True,
              help="Exit 1 when B parts from A (a training-regression gate for CI).")
@click.option("--color/--no-color", "colour", default=None, help="Colour (default: only on a terminal).")
@click.option("--scheduler", metavar="ADDRESS", default=None, help=SCHEDULER_HELP)
def diff(run_a, run_b, rank, json_path, html_path, pdf_path, md_path, fail_on, colour, scheduler):
    """Compare RUN_B (the suspect) with RUN_A (the reference, the run that worked): the setup
    differences (model, optimizer, schedule, precision, batch, versions), the first step and the
    first recorded value where B parts from A, and the findings only one of them has. Printed on
    the terminal; --json, --html, --pdf and --md write it to files as well."""
    to_stdout = _dash_outputs(json_path, html_path, pdf_path, md_path)
    human = sys.stderr if to_stdout else sys.stdout
    files_a, files_b = _rank_files(run_a), _rank_files(run_b)
    files = files_a + files_b
    check_outputs((None if to_stdout == "json" else json_path, html_path, pdf_path,
                   None if to_stdout == "md" else md_path), files)
    with scheduler_for(scheduler) as client:
        a, _ = _load(run_a, len(files_a), client)
        b, _ = _load(run_b, len(files_b), client)
        result = _compared(a, b, rank, client)

    from ..reports.diff_text import diff_lines, render_diff_markdown
    from ..reports.terminal_style import style_for

    echo = _echo_to(human, style_for(human, colour).colour)
    for line in diff_lines(result, a.run_dir, b.run_dir):
        echo(line)
    if json_path:
        text = json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n"
        if to_stdout == "json":
            write_stdout(text)
        else:
            write_output(json_path, text, files)
            echo(f"wrote {json_path}")
    if html_path or pdf_path:
        # matplotlib, jinja and fpdf2 are imported only when a report is asked for; the figures
        # are drawn once for both documents
        from ..reports.diff_figures import diff_figures
        from ..reports.diff_pdf import render_diff_pdf
        from ..reports.diff_report import render_diff_html

        figures = diff_figures(result)
        for path, render in ((html_path, render_diff_html), (pdf_path, render_diff_pdf)):
            if path:
                write_output(path, render(result, a.run_dir, b.run_dir, figures), files)
                echo(f"wrote {path}")
    if md_path:
        text = render_diff_markdown(result, a.run_dir, b.run_dir)
        if to_stdout == "md":
            write_stdout(text)
        else:
            write_output(md_path, text, files)
            echo(f"wrote {md_path}")
    if fail_on == "parted" and result.parted is not None:
        sys.exit(1)


def _compared(a: Trace, b: Trace, rank: int | None, client=None):
    """diff_runs with each run's findings. Runs of one rank (the common case) have their
    detectors run in two worker processes while this one compares them, when the files are big
    enough to repay starting them (parallel.WORKERS_FROM_BYTES): a 1M-step pair is
    ~25 CPU-s of detectors each beside 16-29 of comparison (measured). Runs of several ranks analyze their
    ranks in workers already (analyze's own pool), so they are analyzed one after the other, as
    they are on a Dask cluster (``client``: --scheduler), each rank a task there."""
    pick_rank(a, b, rank)  # (unusable input: one line, before any worker starts)
    if len(a.attempts) == 1 and len(b.attempts) == 1 and client is None \
            and files_bytes(a, b) >= WORKERS_FROM_BYTES:
        try:
            with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
                jobs = []
                for t in (a, b):
                    files = [x.trace.path for x in next(iter(t.attempts.values()))]
                    jobs.append(pool.submit(_findings_of, t.run_dir, files, [safety.path_identity(f) for f in files]))
                result = diff_runs(a, b, rank)
                result.new_findings = new_findings(*(job.result() for job in jobs))
                return result
        except (OSError, NotImplementedError, BrokenProcessPool):
            pass  # (no worker processes here: the detectors run in this process)
    findings = tuple(run_detectors(t, workers=workers_for(len(t.attempts), files_bytes(t)), scheduler=client)
                     for t in (a, b))
    return diff_runs(a, b, rank, findings=findings)


def _findings_of(run_dir: str, files: list[str], passed: list) -> list:
    """In a worker: analyze's findings of a run of one rank (its files: the attempts), which
    this process checked and decoded already (``passed``: their identities then)."""
    safety.trust(passed)
    return run_detectors(load_files(run_dir, files, probed=True))
