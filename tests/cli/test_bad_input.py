"""Every kind of unusable input: one line on stderr saying what is wrong, exit 2, no traceback.

A damaged or blocking file is given to a real process (h5py's C code may crash or hang on it, and
a timeout bounds it): one child process for all such commands (tests.helpers.BoundedCLI: a crash
is the command's, a hang is killed, and the next command gets a new child); wrong usage and paths
that are not traces are refused before any file is read, in this process (invoke_cli)."""

import shutil

import h5py
import pytest

from tests.helpers import SAMPLES, BoundedCLI, invoke_cli


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert lines[0].startswith("Error: ")
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def real_process():
    cli = BoundedCLI(timeout=60)
    yield lambda *args, **env: cli(*args, env=env)[0]
    cli.close()


@pytest.mark.parametrize("command", ["analyze", "info"])
def test_missing_path(tmp_path, command):
    r = invoke_cli(command, tmp_path / "nope")
    assert_one_line_error(r, "does not exist", "Recorder(model, run_dir)")


def test_empty_directory(tmp_path):
    assert_one_line_error(invoke_cli("analyze", tmp_path), "holds no rank*.h5")


def test_not_hdf5(tmp_path):
    (tmp_path / "rank0.h5").write_text("this is a CSV, not a trace\n1,2,3\n")
    assert_one_line_error(invoke_cli("analyze", tmp_path), "not an HDF5 file")


@pytest.mark.parametrize("keep", [0, 5, 4096, 0.5])
def test_truncated(real_process, tmp_path, keep):
    data = (SAMPLES / "healthy_mlp" / "rank0.h5").read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    (tmp_path / "rank0.h5").write_bytes(data[:n])
    r = real_process("analyze", tmp_path)
    assert_one_line_error(r, "rank0.h5")
    assert "truncated" in r.stderr or "corrupt" in r.stderr


def test_foreign_hdf5(tmp_path):
    with h5py.File(tmp_path / "rank0.h5", "w") as f:
        f["weights"] = [1.0, 2.0]
    assert_one_line_error(invoke_cli("info", tmp_path), "not a torchautopsy trace")


def test_newer_schema(tmp_path):
    shutil.copy(SAMPLES / "healthy_mlp" / "rank0.h5", tmp_path / "rank0.h5")
    with h5py.File(tmp_path / "rank0.h5", "r+") as f:
        f.attrs["schema_version"] = 99
    assert_one_line_error(invoke_cli("analyze", tmp_path), "schema 99", "pip install -U torchautopsy")


@pytest.mark.parametrize("args, needle", [
    (["analyze", str(SAMPLES / "healthy_mlp"), "--fail-on", "bogus"], "--fail-on"),
    (["analyze", str(SAMPLES / "healthy_mlp"), "--no-such-option"], "--no-such-option"),
    (["analyze"], "RUN_DIR"),
    (["frobnicate"], "frobnicate"),
])
def test_wrong_usage(args, needle):
    assert_one_line_error(invoke_cli(*args), needle)


def test_unwritable_output(tmp_path):
    r = invoke_cli("analyze", SAMPLES / "healthy_mlp", "--json", tmp_path / "no" / "such" / "dir.json")
    assert_one_line_error(r, "cannot write")


@pytest.mark.parametrize("command", ["analyze", "info"])
@pytest.mark.parametrize("given", ["run", "file"])
def test_a_fifo_named_like_a_trace_is_refused_at_once(real_process, tmp_path, command, given):
    """Issue 38 (3): opening a named pipe blocks until a writer comes, forever: it is refused
    before it is opened (the CLI's timeout of 120 s would fail this test otherwise)."""
    import os

    os.mkfifo(tmp_path / "rank0.h5")
    r = real_process(command, tmp_path if given == "run" else tmp_path / "rank0.h5")
    assert_one_line_error(r, "is not a regular file", "named pipe")


def test_a_directory_or_fifo_beside_a_good_rank_file_is_that_file_s_problem(real_process, tmp_path):
    """Issue 38 (4): a directory named rank0.attempt2.h5 beside an intact rank0.h5 failed the whole
    analysis; now it is an unreadable file, and the good rank is analyzed."""
    import json
    import os

    shutil.copy(SAMPLES / "nan_birth" / "rank0.h5", tmp_path / "rank0.h5")
    (tmp_path / "rank0.attempt2.h5").mkdir()
    os.mkfifo(tmp_path / "rank1.h5")
    r = real_process("analyze", tmp_path, "--json", tmp_path / "f.json")
    assert r.returncode == 0, r.stderr
    found = json.loads((tmp_path / "f.json").read_text())["findings"]
    assert [f["step"] for f in found if f["kind"] == "nonfinite"] == [60]
    unreadable = sorted(f["evidence"]["file"].rsplit("/", 1)[-1] for f in found if f["kind"] == "unreadable_rank")
    assert unreadable == ["rank0.attempt2.h5", "rank1.h5"]


@pytest.mark.parametrize("command", ["info", "analyze"])
def test_a_file_hdf5_would_decode_forever_is_refused_in_bounded_time(real_process, tmp_path, command):
    """Issue 38 (3): 512 zero bytes at this offset of a shipped sample make HDF5's global-heap
    decoder loop forever in C, where no Python timeout reaches. Each file is decoded first in a
    child process with a deadline (analyzer/trace/probe.py), here cut to 3 s."""
    import time

    data = bytearray((SAMPLES / "exploding_cnn" / "rank0.h5").read_bytes())
    data[706325:706325 + 512] = bytes(512)
    (tmp_path / "rank0.h5").write_bytes(bytes(data))
    t0 = time.monotonic()
    r = real_process(command, tmp_path, TORCHAUTOPSY_READ_DEADLINE_S="3")
    assert time.monotonic() - t0 < 30
    assert_one_line_error(r, "did not finish within 3 s", "copy it again")
