"""Every file the CLI writes (reports, findings, exports) goes through here.

What it guarantees, whatever the trace or the directory holds:

- it never writes over a trace: not over a rank file of the run being read (same device and
  inode, so a hard link or another spelling of the path is caught too), nor over any file that
  HDF5 would open, even with ``--force``;
- it never writes through a symbolic link: a link at the output path is refused (see
  ``_refusal``), and the data goes to a new temporary file in the same directory, then
  ``os.replace`` puts it at the path; a link planted after the check is replaced, never followed;
- a write that fails (full disk, interrupt, damaged data found while streaming) leaves no half
  file: the temporary file is removed and the path keeps what it had;
- without ``overwrite`` an existing file is kept (``export`` needs ``--force`` to replace one).

Errors are one line (exit code 2) saying what is wrong and what to do.

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


def _refusal(path: str, protect: Iterable[str], overwrite: bool) -> str | None:
    """Why ``path`` must not be written, or None."""
    if _is_stream(path):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not os.path.isdir(folder):
            return f"cannot write {path}: {os.strerror(errno.ENOENT)} (no folder {folder})"
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
        return (f"{path} is an HDF5 file (a trace?); torchautopsy never writes over one, "
                "even with --force: give another path")
    if not overwrite:
        return f"{path} exists; give --force to overwrite it, or another path"
    # A read-only file is kept, though replacing it would only need the folder to be writable.
    if not (os.access(path, os.W_OK) and os.access(folder, os.W_OK)):
        return f"cannot write {path}: {os.strerror(errno.EACCES)}"
    return None


def check_outputs(paths: Iterable[str | None], protect: Iterable[str] = (), overwrite: bool = False) -> None:
    """Refuse, before any work is done, outputs that ``write_output`` would refuse, and two
    outputs at the same path (the second would silently replace the first)."""
    protect = list(protect)
    seen: dict[object, str] = {}
    for path in paths:
        if not path:
            continue
        why = _refusal(path, protect, overwrite)
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
                 overwrite: bool = False) -> int:
    """Write ``data`` (text, bytes, or chunks of bytes produced while writing) at ``path``
    atomically; return the number of bytes written. Checked again here, not only up front: an
    analysis can take minutes, and the folder may change meanwhile."""
    why = _refusal(path, list(protect), overwrite)
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
        _publish(tmp, path, overwrite)
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


def _publish(tmp: str, path: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)  # replaces whatever is at path (even a link planted since), never follows it
        return
    try:
        os.link(tmp, path)  # atomic, and fails if anything appeared at path since the check
    except FileExistsError:
        raise OutputError(f"{path} exists; give --force to overwrite it, or another path") from None
    except OSError:  # a file system without hard links
        if os.path.lexists(path):
            raise OutputError(f"{path} exists; give --force to overwrite it, or another path") from None
        os.replace(tmp, path)
        return
    _remove(tmp)


def _remove(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass
