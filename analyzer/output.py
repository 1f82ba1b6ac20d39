"""Every file the CLI writes (reports, findings, exports) goes through here.

**The rule, the same for every output of every command** (``analyze``'s ``--json``/``--html``/
``--pdf``/``--md``, ``export``'s files, and any command to come): an existing regular file at the
output path is replaced (reports are regenerated often: re-running into the same ``report.html``
just works), except

- a trace: a rank file of the run being read (same device and inode, so a hard link or another
  spelling of the path is caught too), any file HDF5 would open (its signature where HDF5 looks
  for one), or a rank file's name in the run directory (``rank{N}.h5``, ``rank{N}.attempt{K}.h5``
  and their ``.starting``), which the next analysis would take for a rank;
- a symbolic link (dangling or not): refused rather than replaced or followed, see ``_refusal``;
- a folder, a device, a socket; a pipe or terminal (``/dev/stdout``) is written in place.

A refused output is one line (exit code 2) saying what is wrong and what to do, given before any
work is done (``check_outputs``) and checked again just before writing (``write_output``).
``export --force`` is accepted and does nothing: kept so that scripts written when ``export``
refused an existing file without it still run.

How a file is written: to a new temporary file in the same folder, then ``os.replace`` puts it at
the path, so a link planted after the check is replaced, never followed; a write that fails (full
disk, interrupt, damaged data found while streaming) leaves no half file: the temporary file is
removed and the path keeps what it had.

``-`` is not a path here: the CLI sends an output named ``-`` to ``write_stdout`` (``analyze --json
-``) or refuses it; whatever reaches ``check_outputs`` or ``write_output`` is a file's path.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
from typing import Iterable

import click

# The output path that means stdout (for the CLI: output.py itself never takes it for a file).
STDOUT = "-"

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# HDF5 looks for its signature at 0, 512, 1024, 2048, ... (a file may start with a user block).
_FIRST_USER_BLOCK = 512


class OutputError(click.ClickException):
    """An output that must not or cannot be written: one line, exit code 2."""

    exit_code = 2


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def is_hdf5(path: str) -> bool:
    """Whether a regular file holds the HDF5 signature where HDF5 looks for it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset + len(HDF5_SIGNATURE) <= size:
            os.lseek(fd, offset, os.SEEK_SET)  # (os.pread is not on Windows)
            if os.read(fd, len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                return True
            offset = _FIRST_USER_BLOCK if offset == 0 else offset * 2
        return False
    finally:
        os.close(fd)


def _is_stream(path: str) -> bool:
    """A pipe or a terminal (what /dev/stdout leads to): written in place, it replaces no file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def _rank_name_in_run(path: str, protect: list[str]) -> str | None:
    """The run directory when ``path`` is a rank file's name in it (existing or not), else None."""
    from .trace.attempts import parse_name
    from .trace.format import STARTING_SUFFIX

    name = os.path.basename(path)
    if name.endswith(STARTING_SUFFIX):
        name = name[:-len(STARTING_SUFFIX)]
    if parse_name(name) is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    for trace in protect:
        run_dir = os.path.dirname(os.path.abspath(trace))
        if _identity(run_dir) is not None and _identity(run_dir) == _identity(folder):
            return run_dir
    return None


def _refusal(path: str, protect: list[str]) -> str | None:
    """Why ``path`` must not be written (the rule in this module's docstring), or None."""
    if _is_stream(path):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    run_dir = _rank_name_in_run(path, protect)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not os.path.isdir(folder):
            return f"cannot write {path}: {os.strerror(errno.ENOENT)} (no folder {folder})"
        if run_dir:
            return _RANK_NAME.format(path=path, run_dir=run_dir)
        if not os.access(folder, os.W_OK):
            return f"cannot write {path}: {os.strerror(errno.EACCES)}"
        return None
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    # A link is refused rather than replaced: one planted there (a shared folder, an unpacked
    # ticket) could point at any file, and one the user made means they expect its target to
    # change, which we will not do. A dangling link is refused the same way.
    if stat.S_ISLNK(st.st_mode):
        return (f"{path} is a symbolic link; torchautopsy does not write through links: "
                "give another path, or remove the link")
    if stat.S_ISDIR(st.st_mode):
        return f"{path} is a folder; give the path of a file to write"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a device, pipe or socket); give the path of a file to write"
    for trace in protect:
        if _identity(trace) == (st.st_dev, st.st_ino):
            return f"{path} is the trace being read ({trace}); give another path for the output"
    if is_hdf5(path):
        return (f"{path} is an HDF5 file (a trace?); torchautopsy never writes over one: "
                "give another path")
    if run_dir:
        return _RANK_NAME.format(path=path, run_dir=run_dir)
    # A read-only file is kept, though replacing it would only need the folder to be writable.
    if not (os.access(path, os.W_OK) and os.access(folder, os.W_OK)):
        return f"cannot write {path}: {os.strerror(errno.EACCES)}"
    return None


_RANK_NAME = ("{path} is a rank trace's name in the run directory {run_dir} (the next analysis would "
              "read it as a rank); give another path")


def check_outputs(paths: Iterable[str | None], protect: Iterable[str] = (), overwrite: object = None) -> None:
    """Refuse, before any work is done, outputs that ``write_output`` would refuse, and two
    outputs at the same path (the second would silently replace the first). ``protect``: the
    trace files of the run being read. ``overwrite`` is ignored (every output follows the rule)."""
    protect = list(protect)
    seen: dict[object, str] = {}
    for path in paths:
        if not path:
            continue
        why = _refusal(path, protect)
        if why:
            raise OutputError(why)
        if _is_stream(path):
            continue  # /dev/stdout twice is fine
        key = _identity(path) or os.path.normcase(os.path.abspath(path))
        if key in seen:
            same = f"{path} is named twice" if seen[key] == path else f"{seen[key]} and {path} are the same file"
            raise OutputError(f"{same}; give each output its own path")
        seen[key] = path


def write_output(path: str, data: str | bytes | Iterable[bytes], protect: Iterable[str] = (),
                 overwrite: object = None) -> int:
    """Write ``data`` (text, bytes, or chunks of bytes produced while writing) at ``path``
    atomically, replacing a regular file there; return the number of bytes written. Checked again
    here, not only up front: an analysis can take minutes, and the folder may change meanwhile.
    ``overwrite`` is ignored (every output follows the rule)."""
    protect = list(protect)
    why = _refusal(path, protect)
    if why:
        raise OutputError(why)
    if isinstance(data, str):
        data = data.encode("utf-8", "replace")  # (a lone surrogate left anywhere: "?", never a lost report)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = (data,)
    if _is_stream(path):
        try:
            with open(path, "wb") as f:
                return sum(f.write(chunk) for chunk in data)
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = _temporary(folder, os.path.basename(path))
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    written = 0
    try:
        try:
            old = os.lstat(path)
            if stat.S_ISREG(old.st_mode):
                os.fchmod(fd, stat.S_IMODE(old.st_mode))  # a replaced file keeps its permissions
        except (FileNotFoundError, AttributeError):
            pass
        with os.fdopen(fd, "wb") as f:
            for chunk in data:
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        why = _refusal(path, protect)  # (again: a trace may have appeared there while the data was written)
        if why:
            raise OutputError(why)
        os.replace(tmp, path)  # replaces whatever is at path (even a link planted since), never follows it
    except OSError as e:
        _remove(tmp)
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        _remove(tmp)
        raise
    return written


def write_stdout(data: str | bytes) -> int:
    """Write a document to stdout (an output given as ``-``), after whatever was echoed there; return
    the number of bytes. A reader that went away (``| head``) raises BrokenPipeError: the CLI ends quietly."""
    if isinstance(data, str):
        data = data.encode("utf-8", "replace")
    sys.stdout.flush()
    out = getattr(sys.stdout, "buffer", None)
    if out is None:  # a text-only stream (a test harness)
        sys.stdout.write(data.decode("utf-8"))
    else:
        out.write(data)
    sys.stdout.flush()
    return len(data)


def _temporary(folder: str, name: str) -> tuple[int, str]:
    """A new file (mode 0666 less the umask, like open()) next to the output, never a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(20):
        tmp = os.path.join(folder, f".{name[:100]}.{secrets.token_hex(4)}.torchautopsy-tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free name for a temporary file")


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass
