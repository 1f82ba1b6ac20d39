"""Rank files decoded first in a child process with a deadline, before this process reads them.

HDF5 decodes a file in C, where no Python timeout reaches: 512 zeroed bytes in a trace's global
heap made it loop forever at 100% CPU on the first attribute read, and a damaged file can crash it
outright. So every file is first walked in a forked child: the safety check's walk
(safety.py), which there also reads every attribute, every string dataset whole (the global
heap), and the first and last row of every chunked dataset (their chunk indexes). The child
reports each file as it finishes it, with the identity (device, inode, size, mtime) of the file
it passed; this process trusts that verdict (safety.trust), so its own opens of the file, and
those of the workers it tells, do not walk it again: one walk a file in all. A file the child is
still on when the deadline passes (or that kills it) is that rank's "could not read" and the
child is replaced for the files after it; a file it refused is checked again where it is read,
which says why. One child serves a batch of files: one fork per batch and per damaged file.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from . import safety
from .format import _open


def deadline_s(size_bytes: int) -> float:
    """How long one file may take: 10 s (TORCHAUTOPSY_READ_DEADLINE_S: a slow network filesystem
    may need more), and 1 s more for every 100 MB (the string tables grow with it). A healthy
    trace of 10,000 steps walks in under 0.1 s."""
    try:
        base = float(os.environ.get("TORCHAUTOPSY_READ_DEADLINE_S", "10"))
    except ValueError:
        base = 10.0
    return max(base, 0.1) + size_bytes / 100e6


def damaged(paths: list[str], sizes: list[int]) -> dict[str, str]:
    """{path: why} for the files whose walk did not finish in time or crashed the walking process.
    Files HDF5 refuses with an error are left to the reader, which says why in its own words."""
    bad, keys = checked(paths, sizes)
    safety.trust(keys)  # (opened here, they are not walked again: the child checked them)
    return bad


def checked(paths: list[str], sizes: list[int]) -> tuple[dict[str, str], list]:
    """damaged()'s {path: why}, and the identities of the files the child walked and checked,
    for the process that will open them to trust (this one, or the one a Dask worker answers)."""
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    bad: dict[str, str] = {}
    keys: list = []
    start = 0
    while start < len(paths):
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_walk_all, args=(paths[start:], send), daemon=True)
        child.start()
        send.close()
        i = start
        try:
            while i < len(paths):
                if not recv.poll(deadline_s(sizes[i])):
                    bad[paths[i]] = (f"{paths[i]} could not be read: decoding it did not finish within "
                                     f"{deadline_s(sizes[i]):.0f} s (a damaged structure HDF5 loops on); copy it "
                                     "again from the job's run directory")
                    break
                try:
                    _, key = recv.recv()
                except EOFError:  # the child died on this file (HDF5 crashed on it)
                    bad[paths[i]] = (f"{paths[i]} could not be read: decoding it crashed HDF5 (a damaged file); "
                                     "copy it again from the job's run directory")
                    break
                keys.append(key)
                i += 1
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            recv.close()
        start = i + 1
    return bad, keys


def _walk_all(paths: list[str], send) -> None:
    safety.decoding(True)  # (this process only: it walks, checks and decodes each file once)
    for i, path in enumerate(paths):
        key = None
        try:
            with _open(path) as f:  # (the check's walk, decoding as it goes)
                key = safety.identity(f, path)
        except Exception:
            pass  # (an error HDF5 reports, or a refusal, is the reader's to say: only a hang or a crash counts here)
        send.send((i, key))
    send.close()
