"""Every file the CLI writes goes only where the user asked (issue 20): never over a trace, never
through a symbolic link, never half-written (the rule for existing files: test_output_rule.py); and what ``export`` builds from a hostile trace is bounded and plain.

CLI runs on copies of real traces (sample_traces/, and runs recorded here with CUDA memory
snapshots fed through the recorder's own conversion, as tests/cli/test_memory_snapshot.py does):
in this process (tests.helpers.invoke_cli), except where the real process is the point (a limit
on its memory and its time: run_bounded, one child process for all such commands).
"""

import gzip
import hashlib
import io
import os
import pickle
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.cli.test_bad_input import assert_one_line_error
from tests.cli.test_memory_snapshot import documented_snapshot, record_with
from tests.helpers import SAMPLES, BoundedCLI, invoke_cli


class RefuseGlobals(pickle.Unpickler):
    """Loads only what needs no class or function: str, int, float, bool, None, list, dict, tuple."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def safe_load(path):
    with open(path, "rb") as f:
        return RefuseGlobals(f).load()


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def leftovers(folder):
    return [n for n in os.listdir(folder) if "torchautopsy-tmp" in n]


@pytest.fixture
def run(tmp_path):
    """A copy of a real trace (profiler window, parameter snapshots, samples)."""
    os.mkdir(tmp_path / "run")
    shutil.copy(SAMPLES / "healthy_mlp" / "rank0.h5", tmp_path / "run" / "rank0.h5")
    return tmp_path / "run"


@pytest.fixture(scope="module")
def snap_run(tmp_path_factory):
    """A real run whose trace holds two CUDA memory snapshots (the documented structure)."""
    path = tmp_path_factory.mktemp("snap") / "run"
    record_with(path, [(documented_snapshot(), "schedule"), (documented_snapshot(), "oom")])
    return path


@pytest.fixture
def snap_copy(snap_run, tmp_path):
    shutil.copytree(snap_run, tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture(scope="module")
def run_bounded():
    """The CLI in a process that may not map more than 1 GiB (Linux), killed past 60 s a command:
    one such process for the module's commands (their bounds are the process's, not its start)."""
    cli = BoundedCLI(mem_bytes=2**30, block_torch=True, timeout=60)
    yield cli
    cli.close()


# -- where outputs go ----------------------------------------------------------------------------

def test_two_outputs_at_one_path_are_refused(run, tmp_path):
    """The second would silently replace the first."""
    r = invoke_cli("export", run, "--params", "last", tmp_path / "a.st", "--tensors", "last", tmp_path / "a.st")
    assert_one_line_error(r, "a.st is named twice")
    assert not (tmp_path / "a.st").exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("args", [
    ["export", "{run}", "--profile", "{run}/rank0.h5"],
    ["export", "{run}", "--profile", "{run}/rank0.h5", "--force"],
    ["export", "{run}", "--params", "last", "{run}/rank0.h5", "--force"],
    ["export", "{run}/rank0.h5", "--memory-snapshot", "{run}/rank0.h5", "--force"],
    ["analyze", "{run}", "--json", "{run}/rank0.h5"],
    ["analyze", "{run}", "--md", "{tmp}/hardlink.h5"],  # another name of the same file
])
def test_never_writes_over_the_trace_being_read(run, tmp_path, args):
    os.link(run / "rank0.h5", tmp_path / "hardlink.h5")
    before = digest(run / "rank0.h5")
    r = invoke_cli(*[a.format(run=run, tmp=tmp_path) for a in args])
    assert_one_line_error(r, "is the trace being read", "give another path")
    assert digest(run / "rank0.h5") == before and not leftovers(run)


def test_never_writes_over_another_hdf5_file_even_with_force(run, tmp_path):
    other = tmp_path / "other.h5"
    shutil.copy(SAMPLES / "nan_birth" / "rank0.h5", other)
    before = digest(other)
    for args in (["export", run, "--profile", other, "--force"], ["analyze", run, "--html", other]):
        assert_one_line_error(invoke_cli(*args), "is an HDF5 file", "never writes over one")
    assert digest(other) == before


@pytest.mark.parametrize("command", ["export", "analyze"])
def test_never_writes_through_a_symbolic_link(run, tmp_path, command):
    target = tmp_path / "precious.txt"
    target.write_text("secret")
    os.symlink(target, tmp_path / "link.json")
    os.symlink(tmp_path / "created-by-link.json", tmp_path / "dangling.json")
    for name in ("link.json", "dangling.json"):
        args = (["export", run, "--profile", tmp_path / name, "--force"] if command == "export"
                else ["analyze", run, "--json", tmp_path / name])
        assert_one_line_error(invoke_cli(*args), "is a symbolic link")
        assert os.path.islink(tmp_path / name)
    assert target.read_text() == "secret"
    assert not (tmp_path / "created-by-link.json").exists()


def test_analyze_still_overwrites_its_reports(run, tmp_path):
    out = tmp_path / "f.json"
    out.write_text("old findings")
    os.chmod(out, 0o640)
    r = invoke_cli("analyze", run, "--json", out, "--md", tmp_path / "r.md")
    assert r.returncode == 0, r.stderr
    assert '"findings"' in out.read_text() and (tmp_path / "r.md").exists()
    assert (os.stat(out).st_mode & 0o777) == 0o640  # the replaced file keeps its permissions
    assert not leftovers(tmp_path)


def test_a_link_or_trace_planted_while_writing_is_not_written_through(tmp_path):
    """The last step of a write, after the data: what appeared at the path meanwhile (a link, a
    trace) is checked again, and neither followed nor replaced; the temporary file goes."""
    from torchautopsy.analyzer.output import OutputError, write_output

    target = tmp_path / "target.txt"
    target.write_text("secret")
    plant = {"link.json": lambda p: os.symlink(target, p),
             "trace.json": lambda p: shutil.copy(SAMPLES / "nan_birth" / "rank0.h5", p)}
    for name, needle in (("link.json", "is a symbolic link"), ("trace.json", "is an HDF5 file")):
        out = tmp_path / name

        def chunks():
            yield b"new "
            plant[name](out)  # appears after the first check, while the data is written
            yield b"data"

        with pytest.raises(OutputError, match=needle):
            write_output(str(out), chunks())
        assert target.read_text() == "secret" and not leftovers(tmp_path)
    assert digest(tmp_path / "trace.json") == digest(SAMPLES / "nan_birth" / "rank0.h5")


def _append_blob(trace, data: bytes) -> None:
    """Point profiler window 0 at ``data``, appended to blobs/bytes."""
    with h5py.File(trace, "r+") as f:
        ds = f["blobs/bytes"]
        n0 = ds.shape[0]
        ds.resize((n0 + len(data),))
        ds[n0:] = np.frombuffer(data, np.uint8)
        f["profile_windows/trace_offset"][0] = n0
        f["profile_windows/trace_nbytes"][0] = len(data)


# Made in the test, not at collection: compressing 200 MiB cost every xdist worker ~2 CPU-s.
BLOBS = {"compression bomb": lambda: gzip.compress(b"{" + b" " * (200 * 2**20)),  # 200 MiB from ~200 KB
         "cut short": lambda: gzip.compress(b'{"traceEvents": []}' * 10_000)[:-100]}


@pytest.mark.parametrize("needle", list(BLOBS))
def test_a_write_that_fails_half_way_leaves_the_old_file(run_bounded, run, tmp_path, needle):
    _append_blob(run / "rank0.h5", BLOBS[needle]())
    out = tmp_path / "t.json"
    out.write_text("previous export")
    r, seconds = run_bounded("export", run, "--profile", out, "--force")
    assert_one_line_error(r, "profiler window 0", needle)
    assert out.read_text() == "previous export" and not leftovers(tmp_path)
    assert seconds < 30


def test_a_profile_window_outside_the_blobs_is_refused_before_reading(run_bounded, run, tmp_path):
    with h5py.File(run / "rank0.h5", "r+") as f:
        f["profile_windows/trace_nbytes"][0] = 2**40
    r, _ = run_bounded("export", run, "--profile", tmp_path / "t.json")
    assert_one_line_error(r, "lies outside blobs/bytes")
    assert not (tmp_path / "t.json").exists()


# -- stored tensors: places and sizes checked before anything is read -----------------------------

@pytest.mark.parametrize("column, value, args, needle", [
    ("tensors/nbytes", 2**40, ("--tensors", "last"), "past the end of blobs/bytes"),
    ("tensors/offset", -8, ("--tensors", "last"), "bad place"),
    ("tensors/offset", None, ("--tensors", "last"), "add up to more bytes"),  # rows overlap
    ("snapshots/nbytes", 2**40, ("--params", "last"), "past the end of snapshots/bytes"),  # the slot
])
def test_stored_tensor_places_are_checked_before_reading(run_bounded, run, tmp_path, column, value, args, needle):
    with h5py.File(run / "rank0.h5", "r+") as f:
        if value is None:  # every row in the blobs names all of blobs/bytes
            for i, loc in enumerate(f["tensors/location"][()]):
                if loc in (b"blobs", "blobs"):
                    f["tensors/offset"][i] = 0
                    f["tensors/nbytes"][i] = f["blobs/bytes"].shape[0]
        else:
            f[column][...] = value
    r, seconds = run_bounded("export", run, *args, tmp_path / "o.safetensors")
    assert_one_line_error(r, needle)
    assert seconds < 30 and not (tmp_path / "o.safetensors").exists()


def test_a_5000_digit_integer_in_the_black_box_detail_is_skipped(run_bounded, tmp_path):
    shutil.copytree(SAMPLES / "nan_birth", tmp_path / "run")
    with h5py.File(tmp_path / "run" / "rank0.h5", "r+") as f:
        f["blackbox/detail"][0] = '{"values": {"loss": ' + "9" * 5000 + "}}"
    r, _ = run_bounded("export", tmp_path / "run", "--tensors", "blackbox", tmp_path / "bb.safetensors")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and (tmp_path / "bb.safetensors").stat().st_size > 0


# -- the memory snapshot pickle --------------------------------------------------------------------

def test_the_snapshot_pickle_needs_no_global_and_equals_the_snapshot(snap_copy, tmp_path):
    out = tmp_path / "s.pickle"
    r = invoke_cli("export", snap_copy, "--memory-snapshot", out, "--which", "0", block_torch=True)
    assert r.returncode == 0, r.stderr
    assert safe_load(out) == documented_snapshot()
    # the refusing unpickler does refuse: a pickle with a global fails to load
    with pytest.raises(pickle.UnpicklingError, match="refused global"):
        RefuseGlobals(io.BytesIO(pickle.dumps(np.int64(3)))).load()


def test_plain_converts_numpy_and_refuses_other_objects():
    from torchautopsy.analyzer.memory_snapshot import plain

    shared = [{"filename": "a.py", "line": 1}]
    data = {"n": np.int64(7), "x": np.float32(0.5), "s": np.str_("ok"), "b": b"raw\xff", "t": (np.int32(0), 1),
            "a": np.arange(3), "ok": np.bool_(True), "f1": shared, "f2": shared}
    back = RefuseGlobals(io.BytesIO(pickle.dumps(plain(data)))).load()
    assert back == {"n": 7, "x": 0.5, "s": "ok", "b": "raw\ufffd", "t": (0, 1), "a": [0, 1, 2], "ok": True,
                    "f1": shared, "f2": shared}
    assert back["f1"] is back["f2"]  # shared frame lists stay shared: pickled once
    for bad in (object(), {"k": {1, 2}}, {(1, 2): 3}):
        with pytest.raises(TypeError):
            plain(bad)
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(TypeError, match="deeper"):
        plain(deep)


def test_a_count_of_2_40_device_histories_is_refused_without_allocating(run_bounded, snap_copy, tmp_path):
    with h5py.File(snap_copy / "rank0.h5", "r+") as f:
        n = f["memory_snapshots/n_device_traces"].shape[0]
        del f["memory_snapshots/n_device_traces"]
        f.create_dataset("memory_snapshots/n_device_traces", data=np.full(n, 2**40, np.int64))
    r, seconds = run_bounded("export", snap_copy, "--memory-snapshot", tmp_path / "s.pickle", "--which", "0")
    assert_one_line_error(r, "1,099,511,627,776 device histories", "damaged")
    assert seconds < 30 and not (tmp_path / "s.pickle").exists()


@pytest.mark.parametrize("field", ["memory_snapshots/extra", "memory_snapshots/allocator_settings",
                                   "memory_frames/extra"])
def test_a_5000_digit_integer_in_a_json_field_is_skipped(run_bounded, snap_copy, tmp_path, field):
    with h5py.File(snap_copy / "rank0.h5", "r+") as f:
        f[field][0] = '{"huge": ' + "9" * 5000 + "}"
    out = tmp_path / "s.pickle"
    r, seconds = run_bounded("export", snap_copy, "--memory-snapshot", out, "--which", "0")
    assert r.returncode == 0, r.stderr
    back, want = safe_load(out), documented_snapshot()
    if field.endswith("allocator_settings"):
        want["allocator_settings"] = {}
    assert back == want and seconds < 30


def test_overlapping_stacks_are_refused(run_bounded, snap_copy, tmp_path):
    """Stacks are disjoint runs of frames; overlapping ones would let a small file expand into a
    snapshot of (entries x frames) dicts."""
    with h5py.File(snap_copy / "rank0.h5", "r+") as f:
        n = f["memory_stack_frames/frame"].shape[0]
        f["memory_stacks/first"][...] = 0
        f["memory_stacks/length"][...] = n
    r, _ = run_bounded("export", snap_copy, "--memory-snapshot", tmp_path / "s.pickle")
    assert_one_line_error(r, "memory_stacks", "overlap")


def test_a_pipe_is_written_in_place(run, tmp_path):
    """/dev/stdout (a link to the process's pipe) is a stream, not a file to replace."""
    r = subprocess.run([sys.executable, "-m", "torchautopsy.analyzer.cli", "analyze", str(run),
                        "--json", "/dev/stdout"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"findings": [' in r.stdout


def _all_reports(run_dir, out_dir):
    """analyze RUN with every report, in a fresh interpreter, the run directory's name as bytes."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom torchautopsy.analyzer.cli import main\n"
            "main([sys.argv[1]] + [a for a in sys.argv[2:]])\n")
    outs = [os.path.join(out_dir, f"r.{ext}") for ext in ("json", "html", "pdf", "md")]
    args = [os.fsencode(run_dir), b"--json", outs[0].encode(), b"--html", outs[1].encode(), b"--pdf",
            outs[2].encode(), b"--md", outs[3].encode()]
    r = subprocess.run([sys.executable.encode(), b"-c", code.encode(), b"analyze", *args], capture_output=True,
                       timeout=120, env={**os.environ, "MPLBACKEND": "Agg"})
    return r, outs


def test_every_report_is_written_whatever_the_names_hold(tmp_path):
    """Issue 38 (5): invalid UTF-8 in an attribute, a lone surrogate in the config's JSON, a run
    directory named in bytes that are not UTF-8 made analyze exit 2 with only the JSON written;
    terminal title and colour sequences in a run directory's name reached the terminal raw.

    One full build holds all four (each was a run of its own, four report builds): the directory's
    name holds the non-UTF-8 bytes and the escapes, its trace both bad attributes. Together they
    cannot hide one another: each alone broke "exit 0, every report written, no raw ESC or BEL
    on stdout", so any of them still breaking it fails this run; and each is shown to reach what
    renders it (the name on stdout, escaped, and in the reports; both attributes in the HTML), so
    none went unread because another came first."""
    import os

    import h5py
    import numpy as np

    name = b"run\xff\xfe\x1b]0;pwned\x07\x1b[31mred"  # not UTF-8, and a title and a colour sequence
    run = os.path.join(os.fsencode(tmp_path), name)
    os.makedirs(run)
    shutil.copy(SAMPLES / "nan_birth" / "rank0.h5", os.path.join(run, b"rank0.h5"))
    with h5py.File(os.path.join(run, b"rank0.h5"), "r+") as f:
        f.attrs["host"] = np.bytes_(b"node\xff\xfe01")
        f.attrs["config"] = f.attrs["config"][:-1] + ', "note": "\\ud800x"}'
    out = tmp_path / "out"
    out.mkdir()
    r, outs = _all_reports(run, out)  # a fresh interpreter: the name reaches it as bytes in argv
    assert r.returncode == 0, r.stderr
    assert all(os.path.getsize(p) > 0 for p in outs)
    assert b"\x1b" not in r.stdout and b"\x07" not in r.stdout
    assert b"\\x1b]0;pwned\\x07\\x1b[31mred" in r.stdout  # the name was shown, escaped
    html = open(outs[1], encoding="utf-8").read()
    assert "node\ufffd\ufffd01" in html and "note=\ufffdx" in html, "an attribute did not reach the report"
    assert all("pwned" in open(p, encoding="utf-8").read() for p in (outs[0], outs[1], outs[3]))
