"""One rule for every output of every command (issue 38, point 6; analyzer/output.py): an existing
regular file is replaced, by ``analyze`` and ``export`` alike (``export --force`` is kept, and
changes nothing); a trace never is (the run's own rank files, any HDF5 file, a rank file's name
in the run directory), and no output is written through a symbolic link. A refusal is one line,
exit code 2, and leaves every file as it was.

CLI runs (in this process: tests.helpers.invoke_cli) on copies of a real trace
(sample_traces/healthy_mlp: a profiler window, parameter snapshots, samples).
"""

import os
import shutil

from tests.cli.test_bad_input import assert_one_line_error
# (run: the fixture, a copy of a real trace; digest and leftovers: the files' checks)
from tests.cli.test_output_safety import digest, leftovers, run  # noqa: F401
from tests.helpers import SAMPLES, invoke_cli


def _commands(run, out):
    """Each command writing one output at ``out``: analyze's report, export's file, export --force."""
    return {"analyze": ["analyze", run, "--md", out],
            "export": ["export", run, "--profile", out],
            "export --force": ["export", run, "--profile", out, "--force"]}


def test_every_command_replaces_an_existing_output_file(run, tmp_path):
    """Reports and exports are regenerated often: an existing file at the path is replaced by
    each command, with or without export's --force (a no-op kept for older scripts)."""
    for name, args in _commands(run, tmp_path / "out.txt").items():
        out = tmp_path / "out.txt"
        out.write_text("yesterday's output")
        os.chmod(out, 0o640)
        r = invoke_cli(*args)
        assert r.returncode == 0, (name, r.stderr)
        assert "yesterday" not in out.read_text(), name
        assert ("traceEvents" if name.startswith("export") else "# torchautopsy report") in out.read_text(), name
        assert f"wrote {out}" in r.stdout, name
        assert (os.stat(out).st_mode & 0o777) == 0o640, name  # the replaced file keeps its permissions
        assert not leftovers(tmp_path), name
    help_text = invoke_cli("export", "--help").stdout
    assert "--force" in help_text and "Does nothing" in help_text


def test_no_command_writes_over_a_trace(run, tmp_path):
    """Neither command replaces a trace: the one being read (under another name too), another
    run's HDF5 file, or a rank file's name in the run directory, existing (damaged beyond HDF5's
    recognition: no signature left) or not yet there; with --force neither."""
    other = tmp_path / "other_run.h5"
    shutil.copy(SAMPLES / "nan_birth" / "rank0.h5", other)
    os.link(run / "rank0.h5", tmp_path / "same_trace.json")
    damaged = run / "rank1.h5"
    damaged.write_bytes(b"\0" * 4096)  # a rank file whose header was lost: still the run's
    before = {p: digest(p) for p in (run / "rank0.h5", other, damaged)}
    rank_name = "is a rank trace's name in the run directory"
    cases = [  # (output, commands, what the line says)
        (tmp_path / "same_trace.json", ("analyze", "export --force"), "is the trace being read"),
        (damaged, ("analyze", "export"), "is the trace being read"),
        (other, ("analyze", "export", "export --force"), "is an HDF5 file"),
        (run / "rank7.h5", ("analyze", "export --force"), rank_name),
        (run / "rank0.attempt2.h5", ("export",), rank_name),
        (run / "rank3.h5.starting", ("analyze",), rank_name),
    ]
    for out, commands, needle in cases:
        for name in commands:
            r = invoke_cli(*_commands(run, out)[name])
            assert_one_line_error(r, needle, "give another path")
    assert {p: digest(p) for p in before} == before
    assert sorted(os.listdir(run)) == ["rank0.h5", "rank1.h5"]  # no new "rank" in the run
    assert not leftovers(tmp_path)


def test_no_command_writes_through_a_symbolic_link(run, tmp_path):
    """A link at the output path, to a file or dangling, is refused by each command (one line,
    exit code 2), while a regular file beside it is replaced: the link and its target stay."""
    target = tmp_path / "precious.txt"
    target.write_text("secret")
    os.symlink(target, tmp_path / "link.txt")
    os.symlink(tmp_path / "created-by-link.txt", tmp_path / "dangling.txt")
    for link, commands in (("link.txt", ("analyze", "export", "export --force")), ("dangling.txt", ("analyze", "export"))):
        for name in commands:
            r = invoke_cli(*_commands(run, tmp_path / link)[name])
            assert_one_line_error(r, f"{tmp_path / link} is a symbolic link", "give another path, or remove the link")
            assert os.path.islink(tmp_path / link), name
    assert target.read_text() == "secret"
    assert not (tmp_path / "created-by-link.txt").exists()
    plain = tmp_path / "plain.txt"
    plain.write_text("old")
    for name, args in _commands(run, plain).items():
        assert invoke_cli(*args).returncode == 0, name
        assert plain.read_text() != "old"
        plain.write_text("old")
