"""The ``torchautopsy`` command: analyze and describe run directories.

Unusable input (missing, empty, foreign, truncated or newer traces, a bad ``--config`` file) gives
one line on stderr and exit code 2; ``analyze`` exits 1 when a finding reaches ``--fail-on``, else 0.
"""

from __future__ import annotations

import json
import os
import sys

import click
import numpy as np

from .config import AnalysisConfig
from .config_file import load_config
from .display import NAME_CHARS, TITLE_CHARS, shorten, shorten_words
from .errors import ConfigError, TraceError
from .findings import SEVERITIES, Finding, first_to_go_wrong
from .output import check_outputs, write_output
from .restarts import attempt_lines, blackbox_lines, restart_lines
from .run import analyze as run_detectors, checked_kinds
from .series import spacing
from .trace import Trace, load


class InputError(click.ClickException):
    """Bad input: one line, exit code 2 (click's own usage errors also exit 2)."""

    exit_code = 2


def _load(run_dir: str) -> Trace:
    try:
        return load(run_dir)
    except TraceError as e:
        raise InputError(str(e)) from None


def _load_config(path: str | None) -> AnalysisConfig | None:
    if path is None:
        return None
    try:
        return load_config(path)
    except ConfigError as e:
        raise InputError(str(e)) from None


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _describe_run(trace: Trace) -> str:
    rt0 = next(iter(trace.ranks.values()))
    steps = max(r.n_steps for r in trace.ranks.values())
    n_ranks = len(trace.ranks)
    return (f"{shorten(rt0.meta.get('model_class', '?'), TITLE_CHARS)} "
            f"({rt0.meta.get('n_parameters', 0):,} parameters), "
            f"{n_ranks} rank{'s' if n_ranks != 1 else ''}, {steps:,} steps, "
            f"{rt0.wall_time_s:.1f} s")


def _rank_files(run_dir: str) -> list[str]:
    """The trace files of the run being read: no output is ever written over one (output.py)."""
    from .trace import trace_files

    try:
        return trace_files(run_dir)
    except (TraceError, OSError):
        return []  # loading it will say what is wrong


# A run with more (step x tensor) cells than this is long: its analysis shows progress even when
# stderr is not a terminal (a CI log). TORCHAUTOPSY_PROGRESS=1 / =0 forces the bar on / off.
LONG_RUN_CELLS = 50_000_000


class _Progress:
    """A progress bar on stderr (tqdm) for a long stage of the analysis; silent when disabled.
    ``progress(done, total, what)`` moves it; ``close()`` clears it before anything is printed."""

    def __init__(self, trace: Trace):
        forced = os.environ.get("TORCHAUTOPSY_PROGRESS")
        cells = sum(r.n_steps * max(len(r.param_names), 1) for r in trace.ranks.values())
        self.enabled = forced == "1" or (forced != "0" and (sys.stderr.isatty() or cells > LONG_RUN_CELLS))
        self.bar = None

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="torchautopsy", unit="part", file=sys.stderr, leave=False,
                            mininterval=0.5, dynamic_ncols=True)
        self.bar.total = total
        self.bar.n = done
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="torchautopsy")
def cli():
    """Find what went wrong in a PyTorch training run recorded by torchautopsy.Recorder."""


def main(argv=None) -> None:
    """Entry point: click's usage errors shortened to one line, exit code 2."""
    try:
        code = cli.main(args=argv, prog_name="torchautopsy", standalone_mode=False)
    except click.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `torchautopsy`: show the help
            click.echo(e.ctx.get_help())
            sys.exit(0)
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        click.echo(f"Error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except TraceError as e:  # raised where a command reads lazily, outside its own handling
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
        first = str(e).splitlines()[0][:300] if str(e) else ""
        click.echo(f"Error: torchautopsy could not finish ({type(e).__name__}: {first}); the trace may be "
                   "damaged; if it is not, please report this (TORCHAUTOPSY_DEBUG=1 shows the traceback)",
                   err=True)
        sys.exit(2)
    sys.exit(code or 0)


@cli.command()
@click.argument("run_dir", type=click.Path())
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the findings as JSON.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), help="Write a self-contained HTML report.")
@click.option("--pdf", "pdf_path", type=click.Path(dir_okay=False),
              help="Write the same report as a paginated PDF (A4).")
@click.option("--md", "md_path", type=click.Path(dir_okay=False), help="Write a short Markdown report for a ticket.")
@click.option("--fail-on", type=click.Choice(["error", "warning", "info", "none"]), default="none",
              show_default=True, help="Exit with 1 when a finding of this severity or worse is found.")
@click.option("--config", "config_path", type=click.Path(), metavar="FILE.toml",
              help="Detector thresholds to override: a TOML file with one table per detector kind, "
                   "e.g. [update_ratio] too_large = 0.2 (each detector's CONFIG in analyzer/detectors/ lists its settings).")
@click.option("--open", "open_html", is_flag=True,
              help="Open the HTML report in a web browser (written to a temporary file without --html).")
def analyze(run_dir, json_path, html_path, pdf_path, md_path, fail_on, config_path, open_html):
    """Analyze RUN_DIR (a run directory of rank*.h5 files, or one such file)."""
    cfg = _load_config(config_path)
    traces = _rank_files(run_dir)
    # Reports overwrite a file (people re-run into the same report.html), never a trace or a link;
    # checked before a long analysis, not after.
    check_outputs((json_path, html_path, pdf_path, md_path), traces, overwrite=True)
    trace = _load(run_dir)
    progress = _Progress(trace)
    try:
        progress(0, 1, "running the detectors")
        findings = run_detectors(trace, cfg)
    except TraceError as e:
        raise InputError(str(e)) from None
    finally:
        progress.close()

    click.echo(f"torchautopsy: {trace.run_dir}: {_describe_run(trace)}")
    for line in restart_lines(trace):  # a job restarted into the directory (restarts.py)
        click.echo(f"  {shorten_words(line, NAME_CHARS, INFO_TEXT_CHARS)}")
    for rt in trace.ranks.values():
        if not rt.closed_cleanly:
            click.echo(f"  note: rank {rt.rank} did not close its trace (job killed?); "
                       f"analyzed the {rt.n_steps:,} steps it flushed")
    if not any(f.severity in ("error", "warning") for f in findings):
        checked = ", ".join(checked_kinds(findings))
        click.echo(f"No problem found (checked: {checked}).")
    for f in findings:
        click.echo(_finding_line(f))
    first = first_to_go_wrong(findings)
    ranks_hit = {f.rank for f in findings if f.severity in ("error", "warning")}
    if first is not None and len(trace.ranks) > 1 and len(ranks_hit) > 1:
        click.echo(f"rank {first.rank} went wrong first: {first.kind} at step {first.step:,}"
                   + (f" ({first.evidence['stage']})" if "stage" in first.evidence else ""))
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    if findings:
        click.echo(", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n))
    _blackbox_lines(trace)
    for line in blackbox_lines(trace):  # of attempts before a rank's last
        click.echo(line)

    if json_path:
        doc = {"run_dir": trace.run_dir, "findings": [f.to_dict() for f in findings]}
        write_output(json_path, json.dumps(doc, indent=2, allow_nan=False) + "\n", traces, overwrite=True)
        click.echo(f"wrote {json_path}")
    _write_reports(trace, findings, cfg, html_path, pdf_path, md_path, open_html, progress, traces)

    if fail_on != "none" and any(f.at_least(fail_on) for f in findings):
        sys.exit(1)


def _blackbox_lines(trace: Trace) -> None:
    """Where a black box fired, and the command that takes the moment it broke out."""
    from .export import fired_blackbox

    fired = fired_blackbox(trace)
    if fired:
        rt, row, rank = fired
        when = "before its bad update" if row["params_at"] == "start_of_step" else "after its update"
        click.echo(f"black box: rank {rt.rank} kept step {int(row['step']):,} ({shorten(row['trigger'], NAME_CHARS)}), parameters "
                   f"{when}; take it out with: torchautopsy export {trace.run_dir}{rank} --params blackbox "
                   "params.safetensors --tensors blackbox inputs.safetensors")


def _write_reports(trace, findings, cfg, html_path, pdf_path, md_path, open_html, progress, traces) -> None:
    """Build the report once, render each format asked for, then write them; open the HTML if asked."""
    if not (html_path or pdf_path or md_path or open_html):
        return
    # matplotlib, jinja and fpdf2 are imported only when a report is asked for
    from ..reports import build_report, render_html, render_markdown, render_pdf

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
        write_output(path, content, traces, overwrite=True)
        click.echo(f"wrote {path}")
    if open_html:
        import webbrowser

        url = "file://" + os.path.abspath(html_path)
        if not webbrowser.open(url):
            click.echo(f"could not start a web browser; open {html_path} yourself")


def _temporary_html(trace: Trace) -> str:
    import tempfile

    name = os.path.basename(os.path.normpath(trace.run_dir)) or "run"
    fd, path = tempfile.mkstemp(prefix=f"torchautopsy-{name[:40]}-", suffix=".html")
    os.close(fd)
    return path


# A finding's summary on the terminal is cut to this many characters.
SUMMARY_CHARS = 1000


def _finding_line(f: Finding) -> str:
    # Names come from the trace: each cut (the JSON findings hold them whole), and so is the summary.
    where = ", ".join(shorten(w or "(model)") for w in f.where[:3]) or "-"
    step = f"step {f.step:,}" if f.step is not None else "-"
    rank = f"rank {f.rank}" if f.rank is not None else ""
    head = f"  {f.severity.upper():8} {f.kind:22} {rank:7} {step:12} {where}"
    return f"{head}\n      {shorten_words(f.summary, NAME_CHARS, SUMMARY_CHARS)}"


def _spacing(steps) -> str:
    """' (every N)' or ' (every N-M)' steps between samples, or ''."""
    every = spacing(steps)
    return f" (every {every})" if every else ""


# A line of ``info`` that holds text from the trace is cut to this many characters.
INFO_TEXT_CHARS = 600


@cli.command()
@click.argument("run_dir", type=click.Path())
def info(run_dir):
    """Describe RUN_DIR: ranks, steps, time span, what was recorded, size, versions."""
    trace = _load(run_dir)
    click.echo(f"run directory  {trace.run_dir}")
    click.echo(f"size on disk   {_human_bytes(trace.size_bytes)} in {trace.n_files} file(s)")
    for rt in trace.ranks.values():
        m = rt.meta
        steps = rt.step_index
        span = f"{steps[0]:,}-{steps[-1]:,}" if len(steps) else "none"
        try:
            act, upd = rt.sample_steps("activations"), rt.sample_steps("updates")
        except TraceError:
            act = upd = np.zeros(0, np.int64)
        state = "closed cleanly" if rt.closed_cleanly else "not closed (job killed or still running)"
        # Every string of the trace's metadata is cut for the terminal (a trace may hold anything).
        click.echo(f"\nrank {rt.rank} of {shorten(m.get('world_size', 1))}   {os.path.basename(rt.path)}, "
                   f"{_human_bytes(rt.size_bytes)}, {state}"
                   + (f", end: {shorten_words(m['end_reason'], NAME_CHARS, INFO_TEXT_CHARS)}"
                      if m.get("end_reason") else ""))
        click.echo(f"  steps        {rt.n_steps:,} ({span}), {rt.wall_time_s:.1f} s from "
                   f"{shorten(m.get('start_time', '?'))}")
        for line in attempt_lines(trace, rt.rank):  # a restarted rank: its attempts, one timeline
            click.echo(f"  {shorten_words(line, NAME_CHARS, INFO_TEXT_CHARS)}")
        click.echo(f"  model        {shorten(m.get('model_class', '?'), TITLE_CHARS)}, "
                   f"{m.get('n_parameters', 0):,} parameters")
        click.echo(f"  recorded     {len(rt.param_names)} parameter tensors and {len(rt.module_names)} module "
                   f"outputs every step; activation statistics at {len(act)} steps{_spacing(act)}; "
                   f"update ratios at {len(upd)} steps{_spacing(upd)}")
        pw = rt.profile_windows
        if len(pw):
            spans = ", ".join(f"{int(a)}-{int(b)}" for a, b in zip(pw["step_start"][:8], pw["step_end"][:8]))
            click.echo(f"  profiler     {len(pw)} window(s) at steps {spans}{' ...' if len(pw) > 8 else ''} "
                       f"(torchautopsy export RUN_DIR --profile OUT.json --window N)")
        if isinstance(m.get("profile_note"), str):  # windows deferred, skipped or lost (several Recorders)
            click.echo(f"  {shorten_words('profiler note: ' + m['profile_note'], NAME_CHARS, INFO_TEXT_CHARS)}")
        shards = int((rt.param_shards > 1).sum())
        if shards:
            click.echo(f"  sharded      {shards} parameter tensor(s) split across ranks (FSDP2): this file holds "
                       f"rank {rt.rank}'s shards; analyze combines the ranks")
        snaps = rt.memory_snapshots
        if len(snaps):
            at = ", ".join(f"{int(x):,}" for x in snaps["step"][:8])
            click.echo(f"  CUDA memory  {len(snaps)} allocator snapshot(s) at steps {at}{' ...' if len(snaps) > 8 else ''} "
                       f"(torchautopsy export RUN_DIR --memory-snapshot OUT.pickle --which N)")
        ooms = rt.oom_events
        if len(ooms):
            click.echo(f"  out of memory  {len(ooms)} event(s), first at step {int(ooms['step'].iloc[0]):,} "
                       f"on {shorten(ooms['device'].iloc[0])}")
        try:
            from .export import describe_stored

            for what, _, detail in describe_stored(rt):
                label = {"Parameter snapshots": "snapshots", "Sampled activations and gradients": "samples",
                         "Black box": "black box"}.get(what, "histograms")
                click.echo(f"  {label:12} {shorten_words(detail, NAME_CHARS, INFO_TEXT_CHARS)}")
        except TraceError as e:
            click.echo(f"  tensors      unreadable ({shorten_words(e, width=INFO_TEXT_CHARS)})")
        if m.get("dropped_steps"):
            click.echo(f"  dropped      {shorten(m['dropped_steps'])} steps (the writer fell behind)")
        click.echo(f"  host         {shorten(m.get('host', '?'))}, device {shorten(m.get('device', '?'))}")
        click.echo(f"  versions     trace schema {shorten(m.get('schema_version'))}, "
                   f"{shorten(m.get('created_by', '?'))}, torch {shorten(m.get('torch_version', '?'))}, "
                   f"python {shorten(m.get('python_version', '?'))}")
    for path, reason in trace.unreadable.items():
        click.echo(f"\nunreadable     {shorten_words(reason, width=INFO_TEXT_CHARS)}")
    for _, note in trace.notes:
        click.echo(f"\nnote           {shorten_words(note, NAME_CHARS, INFO_TEXT_CHARS)}")


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
@click.option("--force", is_flag=True, help="Overwrite output files that exist (never a trace).")
def export(run_dir, profile_path, window, snapshot_path, which, params, tensors, rank, force):
    """Export data recorded in RUN_DIR in the formats other tools read."""
    if not (profile_path or snapshot_path or params or tensors):
        raise click.UsageError("nothing to export: give --profile OUT.json, --memory-snapshot OUT.pickle, "
                               "--params WHICH OUT.safetensors or --tensors WHICH OUT.safetensors")
    from .export import ExportError, parse_which, profile_chunks, safetensors_chunks, select_params, select_tensors

    asked = [(select_params, "parameters", params), (select_tensors, "tensors", tensors)]
    try:
        asked = [(fn, what, parse_which(w), out) for fn, what, pair in asked if pair for w, out in [pair]]
    except ExportError as e:
        raise InputError(str(e)) from None
    traces = _rank_files(run_dir)
    check_outputs((profile_path, snapshot_path, *(out for *_, out in asked)), traces, overwrite=force)
    trace = _load(run_dir)
    if rank is None:
        rank = next(iter(trace.ranks))
    if rank not in trace.ranks:
        raise InputError(f"{run_dir} has no rank {rank} (ranks: {', '.join(map(str, trace.ranks))})")
    rt = trace.ranks[rank]
    outputs = []
    try:
        for select, what, which_tensors, out in asked:
            try:
                sel = select(rt, which_tensors)
            except ExportError as e:
                raise InputError(str(e)) from None
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
            n = write_output(path, data, traces, overwrite=force)
            click.echo(f"wrote {path}: {what} ({_human_bytes(n)})")
    except TraceError as e:
        raise InputError(str(e)) from None


def _memory_snapshot(rt, which, rank, path):
    """(path, pickle bytes, description) of one CUDA memory snapshot, rebuilt from its rows.
    Pickle is the viewer's format: written for the user from plain types only, never read by torchautopsy."""
    from .memory_snapshot import pick_snapshot, snapshot_pickle

    n = pick_snapshot(rt, which)
    data = snapshot_pickle(rt, n)
    row = rt.memory_snapshots[rt.memory_snapshots["snapshot"] == n].iloc[0]
    return (path, data,
            f"CUDA memory snapshot {n} of rank {rank} ({row['reason']}, step {int(row['step']):,})")


if __name__ == "__main__":
    main()
