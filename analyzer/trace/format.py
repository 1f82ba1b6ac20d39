"""The trace file format's constants, opening a rank file safely, and decoding its strings."""

from __future__ import annotations

import json
import os
import re
import stat

import h5py
import numpy as np

from ... import trace_schema
from ...trace_schema import FORMAT_NAME, SCHEMA_VERSION  # noqa: F401 (the reader's names for them)
from ..errors import TraceFormatError
from .safety import check_trace_file

# The row of a profiler window's operator table that holds the recorder's own work (its norms,
# statistics and copies, folded into one: they are not the job's operators).
OWN_WORK_RANGE = "torchautopsy.recorder"
# Calls of one module in a step with a site of their own (activity, attention, call_outputs);
# later calls share the last one (recorder/forward/module_watcher.py).
MAX_SITE_CALLS = 16
# The root module's label in the per-module DataFrames and in reports: named_modules() names it
# '' (and so do findings' `where`), which no reader sees as a column.
ROOT_LABEL = "(model)"


def module_label(name: str) -> str:
    return name or ROOT_LABEL
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_RANK_FILE = re.compile(r"^rank(\d+)\.h5$")
# A rank file still being built by the recorder (recorder/trace_file/writer.py renames it when readable).
STARTING_SUFFIX = ".starting"

PARAM_STATS = tuple(c.name for c in trace_schema.columns("params"))
MODULE_STATS = tuple(c.name for c in trace_schema.columns("modules"))
# Per-step steps x tensors datasets where -1 means "not measured on this step" (every real value
# is >= 0): readers that reduce or draw them skip those entries. (steps/'s own such columns
# read as NaN in RankTrace.steps: step_columns.NOT_MEASURED_IS_MINUS_ONE.)
UNMEASURED_IS_NEGATIVE = tuple(f"{t}/{name}" for t in ("params", "modules")
                               for name in trace_schema.minus_one_not_measured(t))

ACTIVATION_STATS = ("mean", "std", "absmax", "zero_frac", "nonfinite")
HIST_KINDS = ("weight", "grad", "activation")
# Tables written once per step: their rows line up, one per step.
_PER_STEP_TABLES = {"steps": ("step",), "params": PARAM_STATS, "modules": MODULE_STATS}


def measured_rows(values) -> np.ndarray:
    """Which rows (steps) of an UNMEASURED_IS_NEGATIVE statistic were measured: some entry >= 0
    or NaN/Inf. A 1-D row gives one bool."""
    v = np.asarray(values, dtype=np.float64)
    return ((v >= 0) | ~np.isfinite(v)).any(axis=-1)


def _file_kind(mode: int) -> str:
    return ("directory" if stat.S_ISDIR(mode) else "named pipe (FIFO)" if stat.S_ISFIFO(mode) else
            "socket" if stat.S_ISSOCK(mode) else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file")


def _open(path: str) -> h5py.File:
    """Open a trace read-only, also one whose writer was killed (SWMR-mode file left open)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise TraceFormatError(f"{path} cannot be read ({e.strerror}); copy it again from the job's run directory")
    if not stat.S_ISREG(mode):  # (a FIFO would block the open forever; a directory, a device)
        raise TraceFormatError(f"{path} is not a regular file (a {_file_kind(mode)}), so not a trace; "
                               "copy the rank files of the run directory as files")
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise TraceFormatError(f"{path} is empty or truncated ({os.path.getsize(path)} bytes); "
                               "it holds no trace")
    if head != _HDF5_SIGNATURE:
        raise TraceFormatError(f"{path} is not an HDF5 file, so not a torchautopsy trace; "
                               "point at the run directory written by Recorder(model, run_dir)")
    try:
        return _checked(h5py.File(path, "r"), path)
    except (OSError, RuntimeError, ValueError) as plain:
        message = str(plain)
    # A killed writer leaves its "open for write" flag set; SWMR readers accept that. Only then
    # do we retry in SWMR mode: on a damaged file an SWMR reader retries reads for a long time.
    if "already open for write" in message:
        try:
            return _checked(h5py.File(path, "r", swmr=True), path)
        except (OSError, RuntimeError, ValueError) as e:
            message = str(e)
    reason = message.split("(", 1)[-1].rstrip(")") if "(" in message else message
    raise TraceFormatError(f"{path} is truncated or corrupt (HDF5 says: {reason}); "
                           "copy it again from the job's run directory")


def rank_of_file(path: str) -> int:
    """The rank a rank file's name gives (rank3.h5: 3); 0 for another name."""
    m = _RANK_FILE.match(os.path.basename(path))
    return int(m.group(1)) if m else 0


def _checked(f: h5py.File, path: str) -> h5py.File:
    """The open file, once safety.check_trace_file has passed it (closed if it does not)."""
    try:
        check_trace_file(f, path)
    except BaseException:
        f.close()
        raise
    return f


# Characters a trace's strings may not carry to a terminal or a report: C0 controls (ESC starts
# ANSI and OSC 8 sequences), DEL, C1 controls (0x9b is a one-byte CSI), and the Unicode bidi
# controls that reorder what a reader sees. Each is shown as its escape, so nothing is hidden.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_OR_LINE = re.compile(_CONTROL.pattern[:-1] + "\t\n]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def clean_text(text: str, lines: bool = True) -> str:
    """A string from a trace with its control characters escaped; with ``lines=False`` tabs and
    newlines too (names: one line each)."""
    pattern = _CONTROL if lines else _CONTROL_OR_LINE
    return pattern.sub(_escape, text) if pattern.search(text) else text


def parse_json(text, default=None):
    """A JSON text from a trace, or ``default`` where it is not valid JSON, holds an integer past
    Python's 4,300-digit limit (a ValueError that is no JSONDecodeError) or nests too deep."""
    if not isinstance(text, str):
        return default
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default


def _decode(v, lines: bool = True) -> str:
    text = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    return clean_text(text, lines)


def _attr(v, lines: bool = False):
    if isinstance(v, (bytes, str)):
        return _decode(v, lines)
    if isinstance(v, np.generic):
        return v.item()
    return v


def _texts(values, lines: bool = True) -> list[str]:
    """UTF-8 strings as h5py returns them (bytes, or str) to str, control characters escaped."""
    return [_decode(v, lines) for v in values]


def _strings(ds) -> list[str]:
    """A dataset of names: one line each."""
    return _texts(ds[()], lines=False)
