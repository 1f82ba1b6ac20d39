"""All file I/O of the recorder: one HDF5 file per rank, written by one thread.

The training thread only puts small numpy rows on a bounded queue (never blocks: a full queue
drops the row and counts it). The writer thread buffers rows, appends them to chunked datasets
and flushes at least every ``flush_every_s`` seconds. The file is in SWMR mode from the first
write on, so a process killed at any moment leaves every flushed row readable
(open it with ``h5py.File(path, "r", swmr=True)`` if a plain open refuses it).

See docs/trace_format.md for the layout this writes.
"""

from __future__ import annotations

import collections
import os
import queue
try:
    import resource  # POSIX only: the file-size limit (RLIMIT_FSIZE)
except ImportError:  # Windows
    resource = None
import threading
import time
import warnings

import h5py
import numpy as np

from .attempts import closing_attrs, publish, reserve
from .schema import GROWS, STR, Column, create_column, fill_value, saturate

_STOP = object()
_FLUSH = object()
_TASK = object()
_WAKE = object()
# Steps' rows wait in a deque that the writer thread drains whenever it wakes: at least every
# flush_every_s (so a job that hangs, then is killed, still leaves its last steps), and when
# training wakes it, every PUT_BATCH steps. Waking it every step cost ~50 us a step (measured):
# the woken thread takes the GIL from training for a moment.
PUT_BATCH = 16
_ABANDONED: list = []  # files whose writes failed: never closed (see TraceWriter._run, _abandon)


def _abandon(writer) -> None:
    """Keep a file whose write failed, and every dataset of it, from ever being closed, also at
    interpreter exit: closing them flushes, the flush fails again, and HDF5 crashed the process
    in the garbage collection at exit (SIGSEGV in H5D_close, or SIGBUS: exit status 139 or 135
    for a job that had finished). One extra reference to each object and its HDF5 id, never
    given back, keeps Python from finalizing them; the operating system closes the file."""
    import ctypes

    objs = [writer._f, writer.__dict__.get("_blobs"), writer.__dict__.get("_snap")]
    objs += [ds for table in writer.__dict__.get("_ds", {}).values() for ds in table.values()]
    _ABANDONED.append(objs)
    for obj in objs:
        for o in (obj, getattr(obj, "id", None)):
            if o is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))
_MARGIN = 2 * 2**20  # bytes kept free beyond the worst case of one write


CLOSE_ROOM = 4 * 2**20  # free bytes a clean close needs: the closing attributes, the metadata cache's flush


class NoRoomError(OSError):
    """The disk (or the process's file-size limit) has no room for the next write."""


class TraceWriter:
    def __init__(self, path: str, attrs: dict, static: dict[str, dict[str, tuple[list, str]]],
                 tables: dict[str, list[Column]], flush_every_s: float, write_every_steps: int,
                 queue_size: int):
        self.path = path
        self.tables = tables
        self.flush_every_s = flush_every_s
        self.write_every = write_every_steps
        self.dropped = 0  # steps dropped because the queue was full
        self.error: BaseException | None = None
        self._task_warned = False
        self._closed = False
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._pending: collections.deque = collections.deque()  # steps' rows for the writer thread
        self._max_pending = queue_size * PUT_BATCH
        self._buf: dict[str, list[dict]] = {t: [] for t in tables}
        self._rows: dict[str, int] = {t: 0 for t in tables}

        # Create the whole layout up front, in the caller's thread, so that a bad path fails
        # loudly at Recorder() and the file is complete (if empty) before training starts.
        # A small chunk cache: rows are appended, so only the last chunk of each dataset is
        # hot; HDF5's default (1 MiB per dataset) grew the job's memory by ~26 MiB (measured).
        # Built under a temporary name and renamed once flushed: a job killed in its first
        # ~50 ms leaves ``rank{N}.h5.starting`` (which the analyzer explains), never a
        # ``rank{N}.h5`` that cannot be opened. Never over an earlier attempt's trace (a job
        # restarted into its run directory): this attempt gets a name of its own, reserved
        # before it is built and published without replacing anything (attempts.py).
        slot = reserve(path)
        self.path = path = slot.path
        attrs = {**attrs, "attempt": slot.attempt, "previous_file": slot.previous}
        self.first_step = 0  # the number of the attempt's first step (attempts.py)
        starting = slot.starting
        self._f = h5py.File(starting, "w", libver="latest", rdcc_nbytes=64 * 1024)
        try:
            self._layout(attrs, static, tables)
            self._f.flush()
            self._f.swmr_mode = True
            publish(starting, path)
        except BaseException:
            self._f.close()
            if os.path.exists(starting):
                os.remove(starting)
            raise
        self._thread = threading.Thread(target=self._run, name="torchautopsy-writer", daemon=True)
        self._thread.start()

    def _layout(self, attrs: dict, static: dict, tables: dict[str, list[Column]]) -> None:
        """Every group and dataset of the trace, empty, and the run's attributes."""
        set_attrs(self._f, attrs)
        for group, datasets in static.items():
            g = self._f.require_group(group)
            for name, (values, dtype) in datasets.items():
                if dtype == "str":
                    g.create_dataset(name, data=np.array(values, dtype=object).reshape(-1), dtype=STR)
                else:
                    g.create_dataset(name, data=np.asarray(values, dtype=dtype).reshape(-1))
        self._ds: dict[str, dict[str, h5py.Dataset]] = {}
        # Each table's worst case for _check_room, (bytes of a new chunk of every dataset, bytes
        # of a row of its fixed-width columns, [(name, itemsize)] of its growing ones), and the
        # current width of its 2-D columns: kept here, not read from the datasets at each write.
        self._room: dict[str, tuple[int, int, list]] = {}
        self._width: dict[str, dict[str, int]] = {}
        for table, cols in tables.items():
            g = self._f.require_group(table)
            self._ds[table] = {}
            chunk_bytes = row_bytes = 0
            grows, widths = [], {}
            for c in cols:
                ds = self._ds[table][c.name] = create_column(g, c)
                item = ds.dtype.itemsize
                chunk_bytes += int(np.prod(ds.chunks)) * item
                if ds.ndim == 1:
                    row_bytes += 16 if c.dtype == "str" else item
                else:
                    widths[c.name] = ds.shape[1]
                    if c.width == GROWS:
                        grows.append((c.name, item))
                    else:
                        row_bytes += ds.shape[1] * item
            self._room[table] = (chunk_bytes, row_bytes, grows)
            self._width[table] = widths
        # Variable-length binary data (gzipped profiler traces), appended; tables hold offsets.
        self._blobs = self._f.create_dataset("blobs/bytes", shape=(0,), maxshape=(None,), dtype="u1",
                                             chunks=(64 * 1024,))
        # Parameter snapshots: a ring of fixed slots rewritten in place (HDF5 never gives back
        # the space of deleted data, so a disk budget is kept by reusing slots). Uncompressed
        # chunks are allocated once and rewritten in place.
        self._snap = self._f.create_dataset("snapshots/bytes", shape=(0,), maxshape=(None,), dtype="u1",
                                            chunks=(64 * 1024,))

    # -- training thread ----------------------------------------------------------------------
    def align(self, step: int) -> None:
        """The attempt's first step is ``step`` (attempts.py): its closing attributes say so."""
        self.first_step = step

    def put(self, rows: dict[str, dict | list[dict]]) -> None:
        """Queue one step's rows, {table: row or [rows]}: all or none of them are written. A
        writer so far behind that the rows pile up drops them (counted) rather than grow."""
        n = len(self._pending)
        if n >= self._max_pending:
            self.dropped += 1
            return
        self._pending.append(rows)  # deque.append/popleft: safe between the two threads
        if (n + 1) % PUT_BATCH == 0:
            self._hand_over()

    def _hand_over(self) -> None:
        """Wake the writer thread to drain the waiting rows (no wait if its queue is full)."""
        try:
            self._q.put_nowait((_WAKE, None))
        except queue.Full:
            pass

    def put_task(self, task, timeout: float = 0.0) -> None:
        """Queue work for the writer thread: task(writer) returns rows like put() takes. A
        failing task warns and is skipped; it does not stop the writer. With a timeout, wait
        that long for room (the black box: once, and worth a wait) instead of dropping it."""
        try:
            if timeout > 0:
                self._q.put((_TASK, task), timeout=timeout)
            else:
                self._q.put_nowait((_TASK, task))
        except queue.Full:
            self.dropped += 1

    def append_blob(self, data: np.ndarray) -> int:
        """Writer thread only: append bytes to blobs/bytes, return their offset."""
        n0 = self._blobs.shape[0]
        self._check_room_bytes(data.size)
        self._blobs.resize(n0 + data.size, axis=0)
        self._blobs[n0:] = data
        return n0

    def write_snapshot_bytes(self, offset: int, data: np.ndarray) -> None:
        """Writer thread only: write bytes into snapshots/bytes at offset (a ring slot), growing
        the dataset if the slot is new."""
        if not data.size:
            return
        end = offset + data.size
        n0 = self._snap.shape[0]
        if end > n0:
            self._check_room_bytes(end - n0)
            self._snap.resize(end, axis=0)
        self._snap[offset:end] = data

    def flush(self, timeout: float = 30.0) -> None:
        """Write and flush everything queued so far; returns when done (or after timeout)."""
        done = threading.Event()
        try:
            self._q.put((_FLUSH, done), timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def close(self, attrs: dict, timeout: float = 60.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._q.put((_STOP, attrs), timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    # -- writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        """The writer thread. It once ran at nice +10, to write in the gaps of the training's
        threads; but it holds the GIL while it runs Python (buffering rows, building columns),
        and a low-priority thread preempted while holding it stalls the training's thread that
        waits for it. At the process's priority the MLP of benchmarks/ (two threads, paired,
        benchmarks/step_kinds.py) cost +0.34, +0.41, +0.47 ms a step recorded, against +0.45 to
        +0.68 at nice +10 and +0.43, +0.44 with SCHED_IDLE (measured)."""
        last_flush = time.monotonic()
        table = row = None
        try:
            while True:
                wait = max(0.05, self.flush_every_s - (time.monotonic() - last_flush))
                try:
                    table, row = self._q.get(timeout=wait)
                except queue.Empty:
                    table, row = None, None
                # The steps' rows first: everything queued after them (a task, a flush) follows.
                while self._pending:
                    self._buffer(self._pending.popleft())
                if table is _STOP:
                    self._write_all()
                    set_attrs(self._f, closing_attrs({**(row or {}), "dropped_steps": self.dropped}, self.first_step))
                    self._f.close()
                    return
                if table is _FLUSH:
                    self._write_all()
                    self._f.flush()
                    last_flush = time.monotonic()
                    row.set()
                    continue
                if table is _TASK:
                    row = self._run_task(row)
                if row is not None and table is not _WAKE:
                    self._buffer(row)
                if time.monotonic() - last_flush >= self.flush_every_s:
                    self._write_all()
                    self._f.flush()
                    last_flush = time.monotonic()
        except BaseException as e:  # disk full, file removed, ...: stop writing, keep training
            self.error = e
            warnings.warn(f"torchautopsy: writing {self.path} failed ({e}); recording stopped, "
                          "the steps flushed before this are still readable", RuntimeWarning)
            # Nothing failed yet, and the disk still holds what closing writes (its attributes and
            # metadata): the file closes cleanly. Otherwise closing would fail, and after a failed
            # close HDF5 crashes the process as it exits (H5D_close): the file is left open.
            if isinstance(e, NoRoomError) and _free_bytes(self.path) >= CLOSE_ROOM:
                try:
                    set_attrs(self._f, {"closed": True, "end_reason": f"recorder error: {e}"})
                    self._f.close()
                except Exception:
                    _abandon(self)
            else:
                # Never touch the file again: closing an HDF5 file after a failed write can
                # crash the process (HDF5 2.0, seen on a full disk). The file object is kept
                # alive, and with it what was flushed, which SWMR keeps readable on disk.
                _abandon(self)
            if table is _FLUSH:
                row.set()
            if table is _STOP:
                return
            # Keep draining so that put() never blocks and flush()/close() never hang.
            while True:
                table, row = self._q.get()
                if table is _FLUSH:
                    row.set()
                if table is _STOP:
                    return

    def _buffer(self, rows: dict) -> None:
        for t, r in rows.items():
            if isinstance(r, list):
                self._buf[t].extend(r)
            else:
                self._buf[t].append(r)
            if len(self._buf[t]) >= self.write_every:
                self._write_table(t)

    def _run_task(self, task) -> dict | None:
        try:
            return task(self)
        except NoRoomError:
            raise
        except Exception as e:
            if not self._task_warned:
                self._task_warned = True
                warnings.warn(f"torchautopsy: a sampled probe could not be stored ({e!r}); "
                              "per-step recording goes on", RuntimeWarning)
            return None

    def _write_all(self) -> None:
        for table in self._buf:
            self._write_table(table)

    def _check_room(self, rows: int, table: str) -> None:
        """Refuse a write the disk may not hold: HDF5 cannot recover from a failed write (the
        process can crash when the file is closed), so a full disk must never be reached.
        The worst case of appending `rows` rows: their bytes plus a new chunk per dataset.
        (From the sizes kept in Python: reading them from the datasets cost ~12 us a column.)"""
        chunk_bytes, row_bytes, grows = self._room[table]
        row = row_bytes + sum(self._width[table][name] * item for name, item in grows)
        self._check_room_bytes(rows * row + chunk_bytes)

    def _check_room_bytes(self, nbytes: int) -> None:
        need = nbytes + _MARGIN
        free = _free_bytes(self.path)
        if free < need:
            raise NoRoomError(f"disk nearly full: {free / 2**20:.1f} MiB left for {self.path}, "
                              f"the next write needs up to {need / 2**20:.1f} MiB")

    def _write_table(self, table: str) -> None:
        rows = self._buf[table]
        if not rows:
            return
        columns = {}
        for c in self.tables[table]:
            values = [r[c.name] for r in rows]
            if c.dtype == "str":
                columns[c.name] = np.array(values, dtype=object)
            elif c.width == GROWS:
                width = max(len(v) for v in values)
                data = np.full((len(rows), width), fill_value(c.dtype), dtype=c.dtype)
                for i, v in enumerate(values):
                    data[i, :len(v)] = v
                columns[c.name] = data
            else:
                columns[c.name] = saturate(values, c.dtype)
        self.write_columns(table, columns)
        self._buf[table] = []

    def write_columns(self, table: str, columns: dict[str, np.ndarray]) -> None:
        """Append rows given column-wise (every column of the table, equally long). The writer
        thread's own path; also used directly by benchmarks/synthetic_trace.py to write large
        traces in the real format before any step is queued."""
        n0 = self._rows[table]
        n = len(next(iter(columns.values())))
        self._check_room(n, table)
        widths = self._width[table]
        for c in self.tables[table]:
            ds = self._ds[table][c.name]
            data = columns[c.name]
            if c.dtype == "str":
                ds.resize(n0 + n, axis=0)
                ds[n0:n0 + n] = data
                continue
            width = widths.get(c.name)
            if c.width == GROWS and data.shape[1] != width:
                if data.shape[1] > width:
                    width = widths[c.name] = data.shape[1]
                else:  # rows written before later sites were seen: pad with the fill value
                    full = np.full((n, width), fill_value(c.dtype), dtype=c.dtype)
                    full[:, :data.shape[1]] = data
                    data = full
            _append(ds.id, n0, n, width, np.ascontiguousarray(data, dtype=c.dtype))
        self._rows[table] = n0 + n


def _append(dsid, n0: int, n: int, width: int | None, data: np.ndarray) -> None:
    """Grow a dataset to n0 + n rows (and `width` columns) and write `data` into rows n0.. with
    h5py's low-level calls: ~15 us a column, where Dataset.resize and slice assignment cost ~55
    (measured, the per-call work of h5py's selection machinery)."""
    shape = (n0 + n,) if width is None else (n0 + n, width)
    dsid.set_extent(shape)
    if not data.size:
        return
    fspace = dsid.get_space()
    fspace.select_hyperslab((n0,) if width is None else (n0, 0), (n,) if width is None else (n, width))
    dsid.write(h5py.h5s.create_simple(data.shape), fspace, data)  # (a wrong shape raises here)


def _free_bytes(path: str) -> float:
    """Bytes the file can still grow by: free disk space, and the RLIMIT_FSIZE limit if set."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        free = float(st.f_bavail * st.f_frsize)
    except (OSError, AttributeError):
        free = float("inf")
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY:
            free = min(free, soft - os.path.getsize(path))
    return free


def set_attrs(obj, attrs: dict) -> None:
    for k, v in attrs.items():
        if isinstance(v, str):  # stored as UTF-8 variable-length strings, readable anywhere
            obj.attrs.create(k, v, dtype=STR)
        else:
            obj.attrs[k] = v
