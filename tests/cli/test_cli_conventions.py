"""The CLI behaves as Unix users expect: ``python -m torchautopsy`` is the command itself; ``-`` sends
``--json`` or ``--md`` to stdout alone (the terminal report goes to stderr); colour only on a
terminal (NO_COLOR, FORCE_COLOR, --color/--no-color); lines wrapped at word boundaries on a
terminal and not at all when piped; a reader closing the pipe ends the command quietly.

What a command writes to a pipe is checked in this process (``piped``: tests.helpers.invoke_cli,
whose stdout and stderr are not terminals, as a pipe's); ``python -m``, a reader closing the pipe
and a terminal run the real CLI in a subprocess; a terminal is a real pseudo-terminal (the pty
module), sized with the TIOCSWINSZ ioctl as a terminal emulator sizes it.
"""

import fcntl
import functools
import json
import os
import pty
import re
import struct
import subprocess
import sys
import tempfile
import termios
from pathlib import Path

import pytest

from tests.helpers import REPO, SAMPLES, invoke_cli, run_cli
from tests.tracebuilder import TraceBuilder

NAN = SAMPLES / "nan_birth"
MANY = SAMPLES / "exploding_lr"  # four findings with long summaries, and a black box
ANSI = re.compile(r"\x1b\[[0-9;]*m")
CLEAN = ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES", "TERM", "TORCHAUTOPSY_PROGRESS")


def environ(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    return {**env, "MPLBACKEND": "Agg", **extra}


def module(*args, cwd=None, **env) -> subprocess.CompletedProcess:
    """``python -m torchautopsy ARGS...`` with stdout and stderr piped."""
    return subprocess.run([sys.executable, "-m", "torchautopsy", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=environ(**env), cwd=cwd or REPO)


def piped(*args, cwd=None, **env) -> subprocess.CompletedProcess:
    """``torchautopsy ARGS...`` in this process, stdout and stderr not terminals (as piped), the
    environment's colour and size settings unset but for ``env``; run in ``cwd`` if given."""
    before = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        return invoke_cli(*args, env={**dict.fromkeys(CLEAN), **env})
    finally:
        os.chdir(before)


def on_terminal(*args, columns: int = 100, **env) -> tuple[int, str, str]:
    """``python -m torchautopsy ARGS...`` with stdout on a pseudo-terminal ``columns`` wide:
    (exit code, what the terminal received, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, "-m", "torchautopsy", *map(str, args)], stdin=stdin,
                             stdout=slave, stderr=err, env=environ(**{"TERM": "xterm", **env}), cwd=REPO)
        os.close(slave)
        received = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            received.append(chunk)
        os.close(master)
        code = p.wait(timeout=120)
        err.seek(0)
        stderr = err.read().decode()
    # A terminal turns "\n" into "\r\n".
    return code, b"".join(received).decode().replace("\r\n", "\n"), stderr


def findings_of(run, tmp_path) -> list[dict]:
    out = tmp_path / "findings.json"
    r = piped("analyze", run, "--json", out)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["findings"]


def told_one_each(findings: list[dict]) -> list[dict]:
    """The findings the terminal prints a line pair each: all but the detectors' "not checked"
    (one line under the verdict says those; the samples' older recorder left some columns out)."""
    return [f for f in findings if not (f["severity"] == "info" and "not checked" in f["summary"])]


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# -- python -m torchautopsy --------------------------------------------------------------------------
def test_python_m_is_the_command_itself():
    """``python -m torchautopsy`` prints and exits (0, 1 for --fail-on, 2 for an error) as main()
    does in this process, and as the console script does (one run: both call the same main)."""
    fail = ("analyze", NAN, "--fail-on", "error")
    runs = {args: module(*args) for args in (fail, ("info", NAN), ("analyze", REPO / "no_such_run"))}
    for args, m in runs.items():
        s = piped(*args, cwd=REPO)
        assert (m.returncode, m.stdout, m.stderr) == (s.returncode, s.stdout, s.stderr)
    assert [m.returncode for m in runs.values()] == [1, 0, 2]  # as the shell sees them
    script = Path(sys.executable).parent / "torchautopsy"
    if script.exists():
        s = subprocess.run([str(script), *map(str, fail)], capture_output=True, text=True, timeout=120,
                           env=environ(), cwd=REPO)
    else:
        s = run_cli(*fail)
    assert (runs[fail].returncode, runs[fail].stdout, runs[fail].stderr) == (s.returncode, s.stdout, s.stderr)
    help_ = module("--help")
    assert help_.returncode == 0 and help_.stdout.startswith("Usage: torchautopsy [OPTIONS] COMMAND")
    assert "analyze" in help_.stdout and "info" in help_.stdout and "export" in help_.stdout


# -- '-' is stdout ---------------------------------------------------------------------------------
def test_json_dash_writes_only_the_json_to_stdout(tmp_path):
    r = piped("analyze", NAN, "--json", "-", "--fail-on", "error", cwd=tmp_path)
    assert r.returncode == 1  # --fail-on still decides the exit code
    doc = json.loads(r.stdout)  # nothing but the JSON
    assert doc["findings"] == findings_of(NAN, tmp_path)
    assert [f["kind"] for f in told_one_each(doc["findings"])] == ["nonfinite"]
    # The terminal report went to stderr, whole.
    assert r.stderr.startswith(f"torchautopsy: {NAN}: ") and "\n1 error\n" in r.stderr
    assert "nonfinite" in r.stderr and "black box:" in r.stderr
    assert not (tmp_path / "-").exists()


def test_md_dash_prints_the_markdown_and_other_outputs_still_go_to_files(tmp_path):
    r = piped("analyze", NAN, "--md", "-", "--json", tmp_path / "f.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# torchautopsy report")
    assert "torchautopsy:" not in r.stdout and "wrote" not in r.stdout
    assert f"wrote {tmp_path / 'f.json'}" in r.stderr  # the human lines are on stderr
    assert json.loads((tmp_path / "f.json").read_text())["findings"] == findings_of(NAN, tmp_path)
    to_file = piped("analyze", NAN, "--md", tmp_path / "r.md")
    assert to_file.returncode == 0 and f"wrote {tmp_path / 'r.md'}" in to_file.stdout
    assert (tmp_path / "r.md").read_text(encoding="utf-8") == r.stdout


@pytest.mark.parametrize("args, needles", [
    (("--html", "-"), ("--html", "path of a file")),
    (("--pdf", "-"), ("--pdf", "path of a file")),
    (("--json", "-", "--md", "-"), ("only one output can be '-'",)),
])
def test_dash_refused_where_stdout_makes_no_sense(tmp_path, args, needles):
    r = piped("analyze", NAN, *args, cwd=tmp_path)
    assert_one_line_error(r, *needles)
    assert os.listdir(tmp_path) == []  # no file named '-'


def test_export_refuses_dash_rather_than_writing_a_file_named_dash(tmp_path):
    r = piped("export", SAMPLES / "healthy_mlp", "--profile", "-", cwd=tmp_path)
    assert_one_line_error(r, "'-'", "path of a file")
    assert os.listdir(tmp_path) == []


def test_a_reader_closing_the_pipe_ends_the_command_quietly():
    p = subprocess.Popen([sys.executable, "-m", "torchautopsy", "analyze", str(MANY), "--json", "-"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ(), cwd=REPO)
    p.stdout.close()  # as `| head -0` would, before the command writes anything
    stderr = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141  # as a process killed by SIGPIPE (1 is --fail-on's)
    assert "Traceback" not in stderr and "Error" not in stderr and "Exception ignored" not in stderr


# -- colour ----------------------------------------------------------------------------------------
def test_piped_and_written_output_holds_no_escape_codes(tmp_path):
    r = piped("analyze", MANY)
    assert r.returncode == 0 and "ERROR" in r.stdout and not ANSI.search(r.stdout + r.stderr)
    # Forced colour reaches the terminal report only, never a document.
    forced = piped("analyze", MANY, "--md", tmp_path / "r.md", "--json", tmp_path / "f.json", FORCE_COLOR="1")
    assert forced.returncode == 0 and ANSI.search(forced.stdout)
    for name in ("r.md", "f.json"):
        assert "\x1b" not in (tmp_path / name).read_text(encoding="utf-8")
    dash = piped("analyze", MANY, "--md", "-", FORCE_COLOR="1")
    assert "\x1b" not in dash.stdout and ANSI.search(dash.stderr)


@functools.cache
def plain_analysis() -> str:
    """What ``analyze MANY`` prints when piped, without colour (run once, not once a case)."""
    return piped("analyze", MANY).stdout


@pytest.mark.parametrize("args, env, coloured", [
    ((), {"FORCE_COLOR": "1"}, True),
    (("--color",), {}, True),
    (("--color",), {"NO_COLOR": "1"}, True),  # the command line wins over the environment
    (("--no-color",), {"FORCE_COLOR": "1"}, False),
    ((), {"FORCE_COLOR": "1", "NO_COLOR": "1"}, False),  # NO_COLOR wins over FORCE_COLOR
    ((), {"FORCE_COLOR": ""}, False),  # empty means unset
])
def test_colour_when_piped_follows_the_options(args, env, coloured):
    r = piped("analyze", MANY, *args, **env)
    assert r.returncode == 0, r.stderr
    assert bool(ANSI.search(r.stdout)) == coloured
    assert ANSI.sub("", r.stdout) == plain_analysis()  # colour changes nothing else


def test_colour_on_a_terminal_and_no_color_turns_it_off():
    code, out, err = on_terminal("analyze", MANY, columns=200)
    assert code == 0, err
    red = "\x1b[31m"
    assert f"  {red}" in out and "ERROR" in out  # the severities
    assert "\x1b[33m" in out  # a warning in yellow
    assert "\x1b[1m3 errors, 1 warning\x1b[0m" in out  # the verdict line is bold
    for env in ({"NO_COLOR": "1"}, {"TERM": "dumb"}):
        code, plain, _ = on_terminal("analyze", MANY, columns=200, **env)
        assert code == 0 and "\x1b" not in plain and "ERROR" in plain
    code, plain, _ = on_terminal("analyze", MANY, "--no-color", columns=200)
    assert "\x1b" not in plain
    code, info, _ = on_terminal("info", MANY, columns=200, NO_COLOR="1")
    assert code == 0 and "\x1b" not in info and "rank 0 of 1" in info


# -- wrapping --------------------------------------------------------------------------------------
@pytest.mark.parametrize("columns, env", [(200, {"COLUMNS": "60"}), (60, {})],
                         ids=["COLUMNS", "terminal-size"])
def test_a_narrow_terminal_wraps_between_words(tmp_path, columns, env):
    findings = told_one_each(findings_of(MANY, tmp_path))
    code, out, err = on_terminal("analyze", MANY, columns=columns, **env)
    assert code == 0, err
    text = ANSI.sub("", out)
    lines = text.splitlines()
    command = next(line for line in lines if line.startswith("    torchautopsy export"))
    # Every line fits, but the command to copy, which keeps a line of its own, whole.
    assert all(len(line) <= 60 for line in lines if line is not command), text
    assert command.strip() == (f"torchautopsy export {MANY} --params blackbox params.safetensors "
                               "--tensors blackbox inputs.safetensors")
    assert len(lines) > 4 * len(findings)  # the summaries were wrapped
    words = text.split()
    for f in findings:  # no word is split: each word of each summary is a word of the output
        for word in f["summary"].split():
            assert word in words, (word, text)
        # and continuation lines are indented under the summary
        first = f["summary"].split()[0]
        assert any(line.startswith(f"      {first} ") for line in lines)


def test_piped_output_is_not_wrapped(tmp_path):
    r = piped("analyze", MANY, COLUMNS="60")
    lines = r.stdout.splitlines()
    for f in told_one_each(findings_of(MANY, tmp_path)):
        assert f"      {f['summary']}" in lines  # one line each, for grep
    TraceBuilder.mlp(layers=3, steps=40).write(tmp_path / "bare")  # no gradient, no loss: "Not checked"
    lines = piped("analyze", tmp_path / "bare", COLUMNS="60").stdout.splitlines()
    assert any(line.startswith("  Not checked, as this trace does not hold what they need: ") and len(line) > 60
               for line in lines)


def test_info_wraps_under_its_values_on_a_terminal():
    code, out, err = on_terminal("info", SAMPLES / "healthy_mlp", columns=60)
    assert code == 0, err
    lines = out.splitlines()
    assert all(len(line) <= 60 for line in lines), out
    recorded = lines.index(next(line for line in lines if line.startswith("  recorded     ")))
    assert lines[recorded + 1].startswith(" " * 15) and not lines[recorded + 1][15].isspace()


def test_long_text_is_cut_between_words_and_marked():
    from torchautopsy.analyzer.display import ELLIPSIS, shorten, shorten_words

    text = " ".join(f"word{i:04d}" for i in range(500))
    cut = shorten_words(text, width=300)
    assert len(cut) <= 300 and f" {ELLIPSIS} " in cut
    head, tail = cut.split(f" {ELLIPSIS} ")
    assert text.startswith(head + " ") and text.endswith(" " + tail)  # whole words on both sides
    assert shorten("model.layers.31." + "a" * 300 + ".mlp.down_proj", 40).count(ELLIPSIS) == 1
