"""The ``torchautopsy`` command: analyze and describe run directories.

Unusable input (missing, empty, foreign, truncated or newer traces, a bad ``--config`` file, an
output that must not be written, a bad command line) gives one line on stderr and exit code 2;
``analyze`` exits 1 when a finding reaches ``--fail-on``, else 0. Commands raise; ``main`` alone
turns an error into its line and exit code. What ``analyze`` and ``info`` print is laid out by
reports/terminal.py, imported when a command runs (``torchautopsy --help`` stays quick).

Conventions: ``python -m torchautopsy`` is the same command. ``-`` as the path of ``--json`` or
``--md`` writes that document to stdout, and the terminal report then goes to stderr (stdout holds
nothing else: ``analyze RUN --json - | jq``). Colour and wrapping at word boundaries only on a
terminal (reports/terminal_style.py: NO_COLOR, FORCE_COLOR, --color/--no-color). A reader that
closes the pipe early (``| head``) ends the command quietly, exit code 141 (as SIGPIPE would).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import click

from .cluster import SCHEDULER_HELP, prober, scheduler_for
from .config_file import load_config
from .display import shorten_words
from .errors import ClusterError, ConfigError, TraceError
from .export import ExportError
from .findings import not_checked
from .output import STDOUT, check_outputs, write_output, write_stdout
from .parallel import files_bytes, workers_for
from .progress import Progress
from .run import analyze as run_detectors
from .trace import Trace, load


class InputError(Exception):
    """A command line asking for what the run does not hold (a rank, a tensor): one line, exit code 2."""


# Unusable input, whichever command met it (a trace may be read lazily, well into a command):
# "Error: <message>" on stderr, exit code 2.
INPUT_ERRORS = (TraceError, ConfigError, ExportError, InputError, ClusterError)


def _rank_files(run_dir: str) -> list[str]:
    """The trace files of the run being read: no output is ever written over one (output.py)."""
    from .trace import trace_files

    try:
        return trace_files(run_dir)
    except (TraceError, OSError):
        return []  # loading it will say what is wrong


def _load(run_dir: str, n_files: int, client=None) -> tuple[Trace, Progress]:
    """The run, its files opened with a progress bar (thousands of ranks take minutes), and the
    bar; with a Dask ``client``, the files are decoded first on its workers (cluster.prober)."""
    progress = Progress(n_files)
    try:
        trace = load(run_dir, progress=progress, prober=None if client is None else prober(client))
    finally:
        progress.close()
    progress.long_run(trace)
    return trace, progress


class StdoutGone(Exception):
    """stdout's reader closed the pipe (``| head``); raised instead of click's own handling of it,
    which exits with 1, the code --fail-on gives."""


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError as e:
            raise StdoutGone() from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="torchautopsy")
def cli():
    """Find what went wrong in a PyTorch training run recorded by torchautopsy.Recorder."""


# The name in the usage lines, the same for the script and ``python -m torchautopsy`` (__main__.py).
PROG_NAME = "torchautopsy"


def main(argv=None) -> None:
    """Entry point: run a command, and turn whatever it raised into one line on stderr and the
    exit code (2: unusable input or an error; 1: a finding reached --fail-on; 130: interrupted;
    141: the reader of stdout went away)."""
    try:
        code = cli.main(args=argv, prog_name=PROG_NAME, standalone_mode=False)
    except click.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `torchautopsy`: show the help
            click.echo(e.ctx.get_help())
            sys.exit(0)
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        click.echo(f"Error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as e:  # an output refused or not written (output.py): exit code 2
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except (StdoutGone, BrokenPipeError):
        _stdout_gone()
    except INPUT_ERRORS as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    except (MemoryError, RecursionError) as e:
        click.echo(f"Error: the trace asks for more than this machine can give ({type(e).__name__}); "
                   "it is damaged or crafted", err=True)
        sys.exit(2)
    except Exception as e:
        # Never a traceback on a user's terminal, and never exit 1 (which --fail-on means):
        # whatever a damaged trace drove us into ends as one line and exit 2.
        if os.environ.get("TORCHAUTOPSY_DEBUG"):
            raise
        first = shorten_words(str(e).splitlines()[0], width=300) if str(e) else ""
        click.echo(f"Error: torchautopsy could not finish ({type(e).__name__}: {first}); the trace may be "
                   "damaged; if it is not, please report this (TORCHAUTOPSY_DEBUG=1 shows the traceback)",
                   err=True)
        sys.exit(2)
    sys.exit(code or 0)


def _stdout_gone() -> None:
    """stdout's reader closed the pipe (``| head``): nothing more can be shown; exit quietly, as a
    process killed by SIGPIPE would, and keep Python's final flush from complaining."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    sys.exit(141)


_COLOR_HELP = ("Colour the severities and the verdict (default: only on a terminal, and not when "
               "NO_COLOR is set; FORCE_COLOR turns it on).")
_DASH = " '-' writes it to stdout (the terminal report then goes to stderr)."


def _dash_outputs(json_path, html_path, pdf_path, md_path) -> str | None:
    """Which output goes to stdout ('-'): 'json', 'md' or None; refuses '-' for the binary or
    large documents and '-' twice (one line, exit code 2)."""
    for name, path in (("--html", html_path), ("--pdf", pdf_path)):
        if path == STDOUT:
            raise click.BadParameter(f"{name[2:].upper()} is not written to stdout; give the path of a file "
                                     "(./- for a file named '-')", param_hint=f"'{name}'")
    dashes = [name for name, path in (("json", json_path), ("md", md_path)) if path == STDOUT]
    if len(dashes) > 1:
        raise click.UsageError("only one output can be '-' (stdout): --json and --md both are; "
                               "give the other the path of a file")
    return dashes[0] if dashes else None


@cli.command(short_help="Find what went wrong in RUN_DIR; write reports (JSON, HTML, PDF, Markdown).")
@click.argument("run_dir", type=click.Path())
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write the findings as JSON;" + _DASH)
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write a self-contained HTML report.")
@click.option("--pdf", "pdf_path", type=click.Path(dir_okay=False),
              help="Write the same report as a paginated PDF (A4).")
@click.option("--md", "md_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write a short Markdown report for a ticket;" + _DASH)
@click.option("--fail-on", type=click.Choice(["error", "warning", "info", "none"]), default="none",
              show_default=True, help="Exit with 1 when a finding of this severity or worse is found.")
@click.option("--config", "config_path", type=click.Path(), metavar="FILE.toml",
              help="Detector thresholds to override: a TOML file with one table per detector kind, "
                   "e.g. [update_ratio] too_large = 0.2 (each detector's CONFIG in analyzer/detectors/ lists its settings).")
@click.option("--open", "open_html", is_flag=True,
              help="Open the HTML report in a web browser (written to a temporary file without --html).")
@click.option("--color/--no-color", "colour", default=None, help=_COLOR_HELP)
@click.option("--scheduler", metavar="ADDRESS", default=None, help=SCHEDULER_HELP)
def analyze(run_dir, json_path, html_path, pdf_path, md_path, fail_on, config_path, open_html, colour, scheduler):
    """Analyze RUN_DIR (a run directory of rank*.h5 files, or one such file).

    Prints the findings (colour and wrapping only on a terminal); exit code 0, or 1 when a finding
    reaches --fail-on, 2 on unusable input. '-' for --json or --md writes that to stdout:
    torchautopsy analyze RUN --json - | jq .
    """
    to_stdout = _dash_outputs(json_path, html_path, pdf_path, md_path)
    human = sys.stderr if to_stdout else sys.stdout  # stdout holds the document alone
    if to_stdout == "json":
        json_path = None
    elif to_stdout == "md":
        md_path = None
    cfg = load_config(config_path) if config_path is not None else None
    traces = _rank_files(run_dir)
    # The one rule of every output (output.py): a report replaces a file, never a trace or a link;
    # checked before a long analysis, not after.
    check_outputs((json_path, html_path, pdf_path, md_path), traces)
    with scheduler_for(scheduler) as client:  # (connected before a long load, so a wrong address is told at once)
        trace, progress = _load(run_dir, len(traces), client)
        try:
            progress(0, 1, "running the detectors")
            workers = workers_for(len(trace.attempts), files_bytes(trace))
            findings = run_detectors(trace, cfg, workers=workers, scheduler=client,
                                     progress=lambda done, total: progress(done, total,
                                                                           f"ranks analyzed: {done:,} of {total:,}"))
        finally:
            progress.close()

    from ..reports.terminal import analyze_lines
    from ..reports.terminal_style import style_for

    style = style_for(human, colour)
    echo = _echo_to(human, style.colour)
    for line in analyze_lines(trace, findings, style):
        echo(line)
    if json_path or to_stdout == "json":
        doc = {"run_dir": trace.run_dir, "findings": [f.to_dict() for f in findings]}
        text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
        if json_path:
            write_output(json_path, text, traces)
            echo(f"wrote {json_path}")
        else:
            write_stdout(text)
    _write_reports(trace, findings, cfg, html_path, pdf_path, md_path, open_html, progress, traces, echo)
    if to_stdout == "md":
        from ..reports import render_markdown

        write_stdout(render_markdown(trace, findings))

    # A detector that could not judge the trace ("not checked") says nothing of the training.
    if fail_on != "none" and any(f.at_least(fail_on) and not not_checked(f) for f in findings):
        sys.exit(1)


def _echo_to(stream, colour: bool):
    """click.echo to ``stream`` (stdout, or stderr when stdout holds a document), coloured or not."""
    err = stream is sys.stderr
    return lambda line: click.echo(line, err=err, color=colour)


def _write_reports(trace, findings, cfg, html_path, pdf_path, md_path, open_html, progress, traces, echo) -> None:
    """Build the report once, render each format asked for, then write them; open the HTML if asked."""
    if not (html_path or pdf_path or md_path or open_html):
        return
    # matplotlib, jinja and fpdf2 are imported only when a report is asked for
    from ..reports import build_report, render_html, render_markdown, render_pdf

    # The figures make many short-lived objects, so gc's full collections come often: frozen, what
    # is already here (the modules, the trace, the findings) is no longer walked by each of them.
    # Collected first, so no garbage is frozen with it (main() may run in a longer-lived process).
    gc.collect()
    gc.freeze()
    outputs: list[tuple[str, str | bytes]] = []
    if html_path or pdf_path or open_html:
        if open_html and not html_path:
            html_path = _temporary_html(trace)
        extra = bool(html_path) + bool(pdf_path)  # rendering steps after the build
        try:
            report = build_report(trace, findings, cfg,
                                  progress=lambda done, total, what: progress(done, total + extra, what))
            n = progress.bar.total - extra if progress.bar is not None else 0
            if html_path:
                progress(n, n + extra, "writing the HTML")
                outputs.append((html_path, render_html(report)))
            if pdf_path:
                progress(n + bool(html_path), n + extra, "laying out the PDF")
                outputs.append((pdf_path, render_pdf(report)))
            progress(n + extra, n + extra, "done")
        finally:
            progress.close()
    if md_path:
        outputs.append((md_path, render_markdown(trace, findings)))
    for path, content in outputs:
        write_output(path, content, traces)
        echo(f"wrote {path}")
    if open_html:
        import webbrowser

        url = "file://" + os.path.abspath(html_path)
        if not webbrowser.open(url):
            echo(f"could not start a web browser; open {html_path} yourself")


def _temporary_html(trace: Trace) -> str:
    import tempfile

    name = os.path.basename(os.path.normpath(trace.run_dir)) or "run"
    fd, path = tempfile.mkstemp(prefix=f"torchautopsy-{name[:40]}-", suffix=".html")
    os.close(fd)
    return path


@cli.command(short_help="Describe RUN_DIR: ranks, steps, what was recorded, size, versions.")
@click.argument("run_dir", type=click.Path())
@click.option("--color/--no-color", "colour", default=None, help=_COLOR_HELP)
def info(run_dir, colour):
    """Describe RUN_DIR: ranks, steps, time span, what was recorded, size, versions."""
    trace, _ = _load(run_dir, len(_rank_files(run_dir)))
    from ..reports.terminal import info_lines
    from ..reports.terminal_style import style_for

    style = style_for(sys.stdout, colour)
    for line in info_lines(trace, style):
        click.echo(line, color=style.colour)


@cli.command()
@click.argument("run_dir", type=click.Path())
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False),
              help="Write a torch.profiler window as a Chrome trace (opens in Perfetto, chrome://tracing).")
@click.option("--window", type=int, default=0, show_default=True, help="Which profiler window.")
@click.option("--memory-snapshot", "snapshot_path", type=click.Path(dir_okay=False), metavar="OUT.pickle",
              help="Write a CUDA memory snapshot as the pickle torch.cuda.memory._dump_snapshot() writes "
                   "(drag it onto https://pytorch.org/memory_viz).")
@click.option("--which", default=None, metavar="N|last|peak|oom",
              help="Which memory snapshot (default: the one taken when memory ran out, else the last).")
@click.option("--params", "params", nargs=2, type=(str, click.Path(dir_okay=False)), metavar="WHICH OUT.safetensors",
              help="Write a parameter snapshot (keys as in model.state_dict()) as safetensors. WHICH: a step "
                   "number (the parameters at the start of that step), 'last', or 'blackbox' (the parameters "
                   "before the bad update).")
@click.option("--tensors", "tensors", nargs=2, type=(str, click.Path(dir_okay=False)), metavar="WHICH OUT.safetensors",
              help="Write sampled activations and gradients (WHICH: a step number or 'last') or the black box's "
                   "inputs, gradients, optimizer state and RNG states ('blackbox') as safetensors.")
@click.option("--rank", type=int, default=None, help="Which rank (default: the lowest recorded).")
@click.option("--force", is_flag=True,
              help="Does nothing: every output replaces a file that exists (never a trace, never through a "
                   "link); kept so that older scripts still run.")
def export(run_dir, profile_path, window, snapshot_path, which, params, tensors, rank, force):
    """Export data recorded in RUN_DIR in the formats other tools read."""
    if not (profile_path or snapshot_path or params or tensors):
        raise click.UsageError("nothing to export: give --profile OUT.json, --memory-snapshot OUT.pickle, "
                               "--params WHICH OUT.safetensors or --tensors WHICH OUT.safetensors")
    from ..reports.terminal import human_bytes
    from .export import parse_which, profile_chunks, safetensors_chunks, select_params, select_tensors

    asked = [(select_params, "parameters", params), (select_tensors, "tensors", tensors)]
    asked = [(fn, what, parse_which(w), out) for fn, what, pair in asked if pair for w, out in [pair]]
    if STDOUT in (profile_path, snapshot_path, *(out for *_, out in asked)):
        raise click.UsageError("export writes files, not stdout: give the path of a file instead of '-' "
                               "(./- for a file named '-')")
    traces = _rank_files(run_dir)
    check_outputs((profile_path, snapshot_path, *(out for *_, out in asked)), traces)  # (--force: a no-op)
    trace = load(run_dir)
    if rank is None:
        rank = next(iter(trace.ranks))
    if rank not in trace.ranks:
        raise InputError(f"{run_dir} has no rank {rank} (ranks: {', '.join(map(str, trace.ranks))})")
    rt = trace.ranks[rank]
    outputs = []
    for select, what, which_tensors, out in asked:
        sel = select(rt, which_tensors)
        if not sel.tensors:
            raise InputError(f"{rt.path}: {sel.description} holds no tensor that safetensors can store")
        skipped = f"; skipped (no safetensors dtype): {', '.join(sel.skipped[:5])}" if sel.skipped else ""
        outputs.append((out, safetensors_chunks(sel), f"{sel.description}, rank {rank} "
                        f"({len(sel.tensors)} tensors){skipped}"))
    if profile_path:
        data = profile_chunks(rt, window)  # unpacked while it is written
        w = rt.profile_windows
        row = w[w["window"] == window].iloc[0]
        outputs.append((profile_path, data, f"profiler window {window} of rank {rank}, steps "
                        f"{int(row['step_start'])}-{int(row['step_end'])}"))
    if snapshot_path:
        outputs.append(_memory_snapshot(rt, which, rank, snapshot_path))
    for path, data, what in outputs:
        n = write_output(path, data, traces)
        click.echo(f"wrote {path}: {what} ({human_bytes(n)})")


def _memory_snapshot(rt, which, rank, path):
    """(path, pickle bytes, description) of one CUDA memory snapshot, rebuilt from its rows.
    Pickle is the viewer's format: written for the user from plain types only, never read by torchautopsy."""
    from .memory_snapshot import pick_snapshot, snapshot_pickle

    n = pick_snapshot(rt, which)
    data = snapshot_pickle(rt, n)
    row = rt.memory_snapshots[rt.memory_snapshots["snapshot"] == n].iloc[0]
    return (path, data,
            f"CUDA memory snapshot {n} of rank {rank} ({row['reason']}, step {int(row['step']):,})")


if __name__ == "__main__":  # (python -m torchautopsy.analyzer.cli: the imported module holds every command)
    from torchautopsy.analyzer import cli as _imported

    _imported.main()


from . import cli_diff  # noqa: E402,F401  (the diff command, registered on `cli`)
