"""Each HDF5 feature that would make the analyzer read another file, load a library or allocate
what a header declares is refused, by every command and by load(), and nothing of the other
file reaches any output. The crafted traces are real traces altered with h5py, as an attacker
would."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from h5py import h5d, h5p, h5s, h5t, h5z

from tests.helpers import invoke_cli, run_cli
from torchautopsy import load
from torchautopsy.analyzer.errors import TraceFormatError

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "sample_traces" / "healthy_mlp" / "rank0.h5"
SECRET = "SECRET-7f3a9c-TOKEN"


def _copy(tmp_path: Path) -> tuple[Path, Path, int]:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(SAMPLE, run / "rank0.h5")
    with h5py.File(run / "rank0.h5", "r") as f:
        n = f["modules/name"].shape[0]
    return run, run / "rank0.h5", n


def _secret_files(tmp_path: Path, n: int) -> tuple[Path, Path]:
    raw = tmp_path / "id_rsa"
    raw.write_text("".join(f"{SECRET}-{i:03d}\n" for i in range(64)))
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as g:
        g["names"] = np.array([f"{SECRET}-{i}".encode() for i in range(n)])
    return raw, other


def _replace_names(path: Path, make) -> None:
    with h5py.File(path, "a") as f:
        del f["modules/name"]
        make(f["modules"])


def external_storage(tmp_path, path, n):
    raw, _ = _secret_files(tmp_path, n)
    _replace_names(path, lambda g: g.create_dataset("name", shape=(n,), dtype="S24",
                                                    external=[(str(raw), 0, h5py.h5f.UNLIMITED)]))


def external_link(tmp_path, path, n):
    _, other = _secret_files(tmp_path, n)
    _replace_names(path, lambda g: g.__setitem__("name", h5py.ExternalLink(str(other), "names")))


def virtual_dataset(tmp_path, path, n):
    _, other = _secret_files(tmp_path, n)

    def make(g):
        layout = h5py.VirtualLayout(shape=(n,), dtype="S24")
        layout[:] = h5py.VirtualSource(str(other), "names", shape=(n,))
        g.create_virtual_dataset("name", layout)
    _replace_names(path, make)


def external_link_in_a_new_table(tmp_path, path, n):
    """A group no reader knows of yet: the check covers the whole file, not a list of tables."""
    _, other = _secret_files(tmp_path, n)
    with h5py.File(path, "a") as f:
        f.create_group("table_of_the_future")["col"] = h5py.ExternalLink(str(other), "names")


def plugin_filter(tmp_path, path, n):
    """bzip2 (filter 307) is not built into HDF5: reading it would load a plugin library."""
    with h5py.File(path, "a") as f:
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_filter(307, h5z.FLAG_OPTIONAL, (9,))
        space = h5s.create_simple((8,), (h5s.UNLIMITED,))
        h5d.create(f["steps"].id, b"extra", h5t.NATIVE_INT32, space, dcpl=dcpl).write(
            h5s.ALL, h5s.ALL, np.arange(8, dtype=np.int32))


def soft_link_loop(tmp_path, path, n):
    with h5py.File(path, "a") as f:
        f["loop_a"] = h5py.SoftLink("/loop_b")
        f["loop_b"] = h5py.SoftLink("/loop_a")


def soft_link(tmp_path, path, n):
    _replace_names(path, lambda g: g.__setitem__("name", h5py.SoftLink("/modules/type")))


def huge_declared_rows(tmp_path, path, n):
    """Every per-step dataset resized to 2**40 rows: no data behind them but fill values."""
    with h5py.File(path, "a") as f:
        for table in ("steps", "params", "modules"):
            for ds in f[table].values():
                if ds.maxshape[0] is None:
                    ds.resize(2**40, axis=0)


def compression_bomb(tmp_path, path, n):
    """A gzip dataset declaring 4 GiB of zeros, stored as one small chunk written many times."""
    import zlib

    chunk = zlib.compress(bytes(4 * 2**20), 9)  # 4 MiB of zeros in ~4 KiB
    with h5py.File(path, "a") as f:
        ds = f["steps"].create_dataset("bomb", shape=(2**30,), dtype="f4", chunks=(2**20,), compression="gzip")
        for i in range(ds.shape[0] // 2**20):
            ds.id.write_direct_chunk((i * 2**20,), chunk)


CASES = [external_storage, external_link, virtual_dataset, external_link_in_a_new_table, plugin_filter,
         soft_link_loop, soft_link, huge_declared_rows, compression_bomb]
LEAKS = {external_storage, external_link, virtual_dataset, external_link_in_a_new_table}


def _cli(*args):
    # In process (the same main(), exit code and stderr): a refusal is the reader's, before any
    # report. The CLI as a real process refuses a file below (test_refusal_names_...).
    return invoke_cli(*args)


@pytest.mark.parametrize("craft", CASES, ids=lambda c: c.__name__)
def test_load_refuses(tmp_path, craft):
    run, path, n = _copy(tmp_path)
    craft(tmp_path, path, n)
    with pytest.raises(TraceFormatError, match=r"refused: /\S+ "):
        load(run)


@pytest.mark.parametrize("craft", CASES, ids=lambda c: c.__name__)
def test_every_command_refuses_in_one_line(tmp_path, craft):
    run, path, n = _copy(tmp_path)
    craft(tmp_path, path, n)
    out = tmp_path / "out"
    out.mkdir()
    commands = [("analyze", run, "--json", out / "f.json", "--html", out / "r.html", "--md", out / "r.md"),
                ("info", run)]
    if craft in LEAKS:
        commands += [("export", run, "--profile", out / "p.json"),
                     ("export", run, "--params", "last", out / "p.safetensors")]
    for cmd in commands:
        r = _cli(*cmd)
        assert r.returncode == 2, (cmd[0], r.returncode, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "refused" in lines[0] and "Traceback" not in r.stderr, r.stderr
        assert SECRET not in r.stdout + r.stderr
    # Nothing was written, so nothing of the other file can be in an output.
    assert not any(out.iterdir()), list(out.iterdir())


def test_refusal_names_the_object_and_the_other_file(tmp_path):
    run, path, n = _copy(tmp_path)
    external_link(tmp_path, path, n)
    r = run_cli("info", run)  # a real process: exit 2, one line, no traceback
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(r"refused: /modules/name is an external link to '.*other\.h5'", r.stderr), r.stderr


def test_a_multi_rank_run_skips_the_refused_rank_and_says_so(tmp_path):
    run, path, n = _copy(tmp_path)
    shutil.copy(path, run / "rank1.h5")
    external_storage(tmp_path, run / "rank1.h5", n)
    out = tmp_path / "f.json"
    r = _cli("analyze", run, "--json", out, "--md", tmp_path / "r.md")
    assert r.returncode == 0, r.stderr
    text = out.read_text() + (tmp_path / "r.md").read_text() + r.stdout
    assert "rank1.h5: refused: /modules/name stores its data in an external file" in out.read_text()
    assert SECRET not in text


def test_only_the_trace_reader_opens_hdf5_files():
    """Every read of a trace goes through format._open, which runs the check: no other module of
    the analyzer or the reports opens an HDF5 file itself."""
    offenders = []
    for folder in ("analyzer", "reports", "toplevel"):
        for p in (REPO / folder).rglob("*.py"):
            if p.relative_to(REPO).as_posix() == "analyzer/trace/format.py":
                continue
            if re.search(r"h5py\.File\(|h5f\.open\(", p.read_text()):
                offenders.append(p.relative_to(REPO).as_posix())
    assert offenders == []


def test_the_recorders_own_traces_pass(tmp_path):
    """The check refuses nothing the recorder writes: every shipped sample loads."""
    for path in sorted((REPO / "sample_traces").glob("*/rank0.h5")):
        assert load(path).ranks, path
