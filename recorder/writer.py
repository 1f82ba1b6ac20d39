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
from dataclasses import dataclass

import h5py
import numpy as np

from .resume import STARTING_SUFFIX, closing_attrs, publish, reserve  # noqa: F401 (STARTING_SUFFIX: for importers)

SCHEMA_VERSION = 2
FORMAT_NAME = "torchautopsy-trace"

_STR = h5py.string_dtype("utf-8")


GROWS = -1  # width of a column whose rows get longer as new sites (layers, heads) are seen


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # numpy dtype string, or "str" for UTF-8 strings
    # None: one value per row; N: N values per row (one per parameter/module); GROWS: as many
    # as seen so far (shorter earlier rows are padded with the fill value)
    width: int | None = None
    # rows per chunk, where the default (about 32 KiB, at least 16 rows) would make a wide,
    # rarely written table allocate megabytes at its first row (histograms)
    chunk_rows: int | None = None


def _fill(dtype: str):
    return np.nan if dtype.startswith("f") else 0


# Tables written per step or per sample; each is an HDF5 group of equally long datasets.
def table_layout(n_params: int, n_modules: int, n_hist_params: int = 0, n_hist_modules: int = 0,
                 n_bins: int = 0) -> dict[str, list[Column]]:
    return {
        "steps": [
            Column("step", "i8"),
            Column("time_s", "f8"),
            Column("loss", "f8"),
            # 1: rec.step() was given a loss (a NaN loss is then a NaN, not a missing one); 0: not.
            Column("loss_given", "i1"),
            Column("rss_bytes", "i8"),
            Column("cuda_allocated_bytes", "i8"),
            Column("cuda_reserved_bytes", "i8"),
            Column("cuda_peak_bytes", "i8"),
            # Where the step's wall time went (host clock): between steps (from the end of the
            # previous rec.step() to this step's first forward: loading data, and whatever else
            # the loop does), of which waiting in DataLoader.__next__ (NaN if no DataLoader was
            # used), forward, backward plus optimizer (to this rec.step() call), and the
            # recorder's own work in rec.step().
            Column("between_steps_s", "f4"),
            Column("data_wait_s", "f4"),
            Column("forward_s", "f4"),
            Column("backward_s", "f4"),
            Column("recorder_s", "f4"),
            Column("nonfinite_origin", "i4"),
            Column("batch_nonfinite", "i1"),
            # The module that turned a -Inf made by nonfinite_origin into NaN/+Inf (-1: none).
            Column("nonfinite_consumer", "i4"),
            # On watched steps: 1 if the gradient that reached the model's outputs in the backward
            # pass held NaN/Inf (born in the loss's backward), 0 if finite; -1 not measured.
            Column("output_grad_nonfinite", "i1"),
            # Census of live tensors, every `census_every` steps (-1 on other steps).
            Column("live_tensors", "i8"),
            Column("live_tensor_bytes", "i8"),
            Column("live_tensors_with_graph", "i8"),
            # Python's garbage collector during the step (gc.callbacks): seconds spent collecting,
            # and how many full (generation 2) collections ran.
            Column("gc_s", "f4"),
            Column("gc_gen2", "i4"),
            # The optimizer's schedule (schedule.py): the learning rate the step's update used
            # (the first optimizer's first param group; NaN if none was seen), AMP's loss scale
            # after the step (NaN without a GradScaler), and how many optimizer steps of the
            # model ran (0: skipped, by the GradScaler or the loop; -1: no optimizer ever seen).
            Column("lr", "f8"),
            Column("loss_scale", "f4"),
            Column("optimizer_steps", "i4"),
        ],
        # Every numeric hyper-parameter of each param group (lr, momentum, betas.0, weight_decay,
        # ...): a row when first seen and whenever it changes; a value holds until its next row.
        "hyperparams": [
            Column("step", "i8"),
            Column("optimizer", "i4"),  # index into optimizers/
            Column("group", "i4"),
            Column("name", "str"),
            Column("value", "f8"),
        ],
        "optimizers": [Column("optimizer", "i4"), Column("class", "str"), Column("first_step", "i8")],
        "params": [
            Column("grad_norm", "f4", n_params),
            Column("grad_absmax", "f4", n_params),
            Column("grad_nonfinite", "i4", n_params),  # saturates at 2**31-1
            Column("param_norm", "f4", n_params),
        ],
        "modules": [Column("output_absmax", "f4", n_modules)],
        "activations": [
            Column("step", "i8"),
            Column("mean", "f4", n_modules),
            Column("std", "f4", n_modules),
            Column("absmax", "f4", n_modules),
            Column("zero_frac", "f4", n_modules),
            Column("nonfinite", "i4", n_modules),
        ],
        "updates": [Column("step", "i8"), Column("ratio", "f4", n_params)],
        # Activation-function call sites (per unit activity, saturation), appended when first seen.
        "activity_sites": [
            Column("module", "i4"),  # index into modules/name: innermost module that called it
            Column("function", "str"),  # relu, relu6, leaky_relu, gelu, hardtanh, tanh, sigmoid
            Column("call", "i4"),  # n-th such call within one forward of that module
            Column("param", "f8"),  # negative_slope of leaky_relu, max_val of hardtanh; else NaN
            Column("unit_dim", "i4"),
            Column("units", "i8"),  # 0 for sites without per-unit tracking (tanh, sigmoid)
            Column("bit_offset", "i8"),  # where its units start in activity/ever_positive bits
            Column("first_step", "i8"),
        ],
        # One row per window of `activity_window` steps.
        "activity": [
            Column("step_start", "i8"),
            Column("step_end", "i8"),
            Column("steps_seen", "i4", GROWS),  # per site: steps of the window it was called in
            Column("steps_watched", "i4"),  # steps of the window the recorder hooked the modules on
            Column("ever_positive", "u1", GROWS),  # bits (little-endian per byte), one per unit
            Column("saturated_frac", "f4", GROWS),  # per site: share of saturated outputs
        ],
        # The live tensor census by group (device, dtype, shape, holds a graph), per census step:
        # the largest groups by bytes and the most numerous (memory.py).
        "census_groups": [
            Column("step", "i8"),
            Column("device", "str"),
            Column("dtype", "str"),
            Column("shape", "str"),  # e.g. "[64, 50, 128]"; "[]" for a scalar
            Column("graph", "i1"),
            Column("count", "i8"),
            Column("bytes", "i8"),
            Column("grad_fn", "str"),  # the graph's last op (e.g. ReluBackward0); "" without a graph
        ],
        # The shape of each module's first floating-point output, when first seen: lets the
        # analyzer tell which module made the tensors of a growing census group.
        "module_outputs": [Column("module", "i4"), Column("shape", "str"), Column("dtype", "str"),
                           Column("grad_fn", "str")],
        # The loss function on the first steps that went NaN/Inf (loss_graph.py): whether the
        # model's outputs were finite on the step itself (1 NaN/Inf, 0 finite, -1 not known) and
        # the loss's autograd ops from the loss to the outputs (JSON list; null: not found).
        "loss_checks": [Column("step", "i8"), Column("outputs_nonfinite", "i1"), Column("ops", "str")],
        # torch.profiler windows (profiler.py); the gzipped Chrome trace of each is in blobs/.
        "profile_windows": [
            Column("window", "i4"),
            Column("step_start", "i8"),
            Column("step_end", "i8"),
            Column("trace_offset", "i8"),  # into blobs/bytes
            Column("trace_nbytes", "i8"),
            # When the writer thread had exported the window (time.time()): until then its work
            # (parsing and compressing the trace, under the GIL) slows the training's next steps.
            Column("exported_unix", "f8"),
        ],
        "profile_ops": [  # one row per operator (torch.profiler key_averages) per window
            Column("window", "i4"),
            Column("name", "str"),
            Column("calls", "i8"),
            Column("cpu_self_us", "f8"),
            Column("cpu_total_us", "f8"),
            Column("device_self_us", "f8"),
            Column("device_total_us", "f8"),
            Column("cpu_memory_bytes", "i8"),
            Column("device_memory_bytes", "i8"),
        ],
        # The CUDA caching allocator's snapshots (cuda_memory.py), one row each; their segments,
        # blocks and history entries in the tables below, keyed by `snapshot`. `keys` columns: a
        # bit mask of the optional keys the snapshot's dicts had (cuda_memory.*_KEYS order).
        "memory_snapshots": [
            Column("snapshot", "i4"),
            Column("step", "i8"),  # the step it was taken in (at rec.step(), or when memory ran out)
            Column("reason", "str"),  # schedule, peak, oom, exception
            Column("time_s", "f8"),
            Column("device", "i4"),
            Column("allocated_bytes", "i8"),
            Column("reserved_bytes", "i8"),
            Column("n_device_traces", "i4"),
            Column("allocator_settings", "str"),  # JSON; "" when the snapshot had none
            Column("keys", "i4"),
            Column("extra", "str"),  # JSON of the snapshot's other keys (external_annotations, ...)
        ],
        "memory_segments": [
            Column("snapshot", "i4"),
            Column("device", "i8"),
            Column("address", "i8"),
            Column("total_size", "i8"),
            Column("allocated_size", "i8"),
            Column("active_size", "i8"),
            Column("requested_size", "i8"),
            Column("stream", "i8"),
            Column("segment_type", "str"),
            Column("pool_a", "i8"),
            Column("pool_b", "i8"),
            Column("is_expandable", "i1"),
            Column("stack", "i8"),  # row of memory_stacks; -1: none
            Column("keys", "i4"),
            Column("extra", "str"),  # keys not listed here, as JSON ("" if none)
        ],
        "memory_blocks": [
            Column("snapshot", "i4"),
            Column("segment", "i4"),  # index of its segment among the snapshot's segments
            Column("address", "i8"),
            Column("size", "i8"),
            Column("requested_size", "i8"),
            Column("state", "str"),  # active_allocated, active_pending_free, inactive
            Column("stack", "i8"),
            Column("keys", "i4"),
            Column("extra", "str"),
        ],
        "memory_trace": [  # the allocator's history (ring buffer) as of the snapshot
            Column("snapshot", "i4"),
            Column("device", "i4"),
            Column("action", "str"),  # alloc, free_requested, free_completed, segment_alloc, ..., oom
            Column("addr", "i8"),
            Column("device_free", "i8"),  # oom entries only
            Column("size", "i8"),
            Column("stream", "i8"),
            Column("time_us", "i8"),
            Column("compile_context", "str"),
            Column("user_metadata", "str"),
            Column("stack", "i8"),
            Column("keys", "i4"),
            Column("extra", "str"),
        ],
        # Stack frames, each stored once; a stack is a run of rows of memory_stack_frames.
        "memory_frames": [Column("filename", "str"), Column("line", "i8"), Column("name", "str"),
                          Column("keys", "i4"), Column("extra", "str")],
        "memory_stacks": [Column("first", "i8"), Column("length", "i4")],
        "memory_stack_frames": [Column("frame", "i8")],
        # Running out of memory: the allocator's out-of-memory observer (CUDA) or an
        # out-of-memory exception leaving the `with Recorder(...)` block (CUDA or CPU).
        "oom_events": [
            Column("step", "i8"),  # the step that was running (no rec.step() came for it)
            Column("time_s", "f8"),
            Column("source", "str"),  # observer or exception
            Column("device", "str"),
            Column("requested_bytes", "i8"),  # -1: unknown
            Column("device_allocated_bytes", "i8"),  # by the caching allocator's tensors
            Column("device_reserved_bytes", "i8"),  # held by the caching allocator
            Column("device_free_bytes", "i8"),  # free on the device, as CUDA reports it
            # The device's memory (or the limit set by set_per_process_memory_fraction): the
            # observer's third argument (which PyTorch's docs call "device_allocated").
            Column("device_total_bytes", "i8"),
            Column("rss_bytes", "i8"),
            Column("snapshot", "i4"),  # memory_snapshots row taken then; -1: none
            Column("message", "str"),
            Column("raised_at", "str"),  # innermost frames of the exception, "file:line in fn" lines
        ],
        # The tensor census taken when memory ran out, by group as in census_groups.
        "oom_tensor_groups": [
            Column("event", "i4"),  # row of oom_events
            Column("device", "str"),
            Column("dtype", "str"),
            Column("shape", "str"),
            Column("graph", "i1"),
            Column("count", "i8"),
            Column("bytes", "i8"),
            Column("grad_fn", "str"),
        ],
        "attention_sites": [
            Column("module", "i4"),
            Column("source", "str"),  # MultiheadAttention or scaled_dot_product_attention
            Column("call", "i4"),
            Column("heads", "i4"),
            Column("head_offset", "i8"),  # where its heads start in the per-head columns
            Column("first_step", "i8"),
        ],
        "attention": [  # sampled steps
            Column("step", "i8"),
            Column("entropy", "f4", GROWS),  # per head: mean row entropy / log(allowed keys)
            Column("max_weight", "f4", GROWS),  # per head: mean of each row's largest weight
            Column("sink_share", "f4", GROWS),  # per head: share of mass on the top key
            Column("head_similarity", "f4", GROWS),  # per site: mean pairwise cosine of heads
            Column("keys", "i4", GROWS),  # per site: number of keys
        ],
        # Stored tensors (tensors.py): parameter snapshots, sampled activations and gradients,
        # the black box. One row per tensor; its raw bytes (exact dtype, C order, little-endian)
        # are in blobs/bytes or snapshots/bytes at [offset, offset + nbytes).
        "tensors": [
            Column("source", "str"),  # snapshot | sample | blackbox
            Column("step", "i8"),
            Column("name", "str"),  # state_dict key; or module.activation / module.grad; or input key
            Column("role", "str"),  # param | buffer | activation | grad | input | optimizer | rng
            Column("dtype", "str"),  # torch dtype without "torch.", e.g. bfloat16
            Column("shape", "str"),  # JSON list
            Column("location", "str"),  # blobs | snapshots
            Column("offset", "i8"),
            Column("nbytes", "i8"),
        ],
        # One row per parameter snapshot written into a slot of the snapshot ring
        # (snapshots/bytes); a slot holds the snapshot of its latest row.
        "snapshots": [
            Column("step", "i8"),  # parameters as they were at the start of this step
            Column("slot", "i4"),
            Column("offset", "i8"),  # into snapshots/bytes
            Column("nbytes", "i8"),
            Column("crc32", "i8"),  # zlib.crc32 of those bytes: a slot torn by a kill fails it
            Column("dtype", "str"),  # "exact", or the half-precision dtype floats were stored in
        ],
        "blackbox": [
            Column("step", "i8"),
            Column("trigger", "str"),  # what set it off (grad_nonfinite, loss_nonfinite, ...)
            Column("params_at", "str"),  # start_of_step (before the bad update) | end_of_step | at_exit
            Column("detail", "str"),  # JSON: affected parameters, optimizer, what was captured
        ],
        # Sampled histograms (histograms.py): counts per bin of histogram_bins/, for the tensors
        # listed in histogram_params/ and histogram_modules/.
        "histograms": [
            Column("step", "i8"),
            Column("weight", "i4", n_hist_params * n_bins, chunk_rows=1),
            Column("grad", "i4", n_hist_params * n_bins, chunk_rows=1),
            Column("activation", "i4", n_hist_modules * n_bins, chunk_rows=1),
        ],
    }


def _chunk_rows(width: int, itemsize: int) -> int:
    # About 32 KiB per chunk (a small run stays small: each dataset holds at least one). Chunks are not compressed on purpose: HDF5 allocates an
    # uncompressed chunk once and a flush rewrites it in place, whereas a compressed chunk is
    # re-allocated at every flush that touches it and, in SWMR mode, its old space is never
    # reused (600 one-row flushes grew a 120 KB gzip dataset to 30 MB; measured).
    return int(max(16, min(4096, (32 * 1024) // max(1, width * itemsize))))


_STOP = object()
_FLUSH = object()
_TASK = object()
_WAKE = object()
# Steps' rows wait in a deque that the writer thread drains whenever it wakes: at least every
# flush_every_s (so a job that hangs, then is killed, still leaves its last steps), and when
# training wakes it, every PUT_BATCH steps. Waking it every step cost ~50 us a step (measured):
# the woken thread takes the GIL from training for a moment.
PUT_BATCH = 16
_ABANDONED: list = []  # files whose writes failed: never closed (see TraceWriter._run)
_MARGIN = 2 * 2**20  # bytes kept free beyond the worst case of one write


_F32_MAX = float(np.finfo(np.float32).max)
_I32 = np.iinfo(np.int32)


def saturate(values, dtype: str) -> np.ndarray:
    """Rows of numbers as a column of ``dtype``, done here in bulk rather than per step in the
    training thread. float32: finite values saturate at float32's max, so that only a real
    NaN/Inf is stored as one (a norm of 1e40 is stored as 3.4e38, not as Inf); int32: counts
    saturate at its max."""
    if dtype == "f4":
        x = np.asarray(values, dtype=np.float64)
        return np.where(np.isfinite(x), np.clip(x, -_F32_MAX, _F32_MAX), x).astype(np.float32)
    if dtype == "i4":
        return np.clip(np.asarray(values, dtype=np.int64), _I32.min, _I32.max).astype(np.int32)
    return np.array(values, dtype=dtype)


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
        # before it is built and published without replacing anything (resume.py).
        slot = reserve(path)
        self.path = path = slot.path
        attrs = {**attrs, "attempt": slot.attempt, "previous_file": slot.previous}
        self.first_step = 0  # the number of the attempt's first step (resume.py)
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
                    g.create_dataset(name, data=np.array(values, dtype=object).reshape(-1), dtype=_STR)
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
                ds = self._ds[table][c.name] = self._create(g, c)
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

    @staticmethod
    def _create(g: h5py.Group, c: Column) -> h5py.Dataset:
        if c.dtype == "str":
            return g.create_dataset(c.name, shape=(0,), maxshape=(None,), dtype=_STR, chunks=(256,))
        item = np.dtype(c.dtype).itemsize
        if c.width is None:  # 1,024 rows (8 KiB of int64): ~30 such columns stay small
            shape, maxshape, chunks = (0,), (None,), (1024,)
        elif c.width == GROWS:
            # 128 rows x 32 columns: a few heads or sites per layer fill a chunk's width, and
            # a short run stays one chunk tall (16 KiB for float32).
            shape, maxshape, chunks = (0, 0), (None, None), (128, 32)
        else:  # a model without parameters still gets its (steps x 0) datasets
            shape, maxshape = (0, c.width), (None, c.width or None)
            chunks = (c.chunk_rows or _chunk_rows(c.width, item), max(1, c.width))
        return g.create_dataset(c.name, shape=shape, maxshape=maxshape, dtype=c.dtype, chunks=chunks,
                                fillvalue=_fill(c.dtype))

    # -- training thread ----------------------------------------------------------------------
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
            if isinstance(e, NoRoomError):  # nothing failed: the file closes cleanly
                try:
                    set_attrs(self._f, {"closed": True, "end_reason": f"recorder error: {e}"})
                    self._f.close()
                except Exception:
                    _ABANDONED.append((self._f, self._ds))
            else:
                # Never touch the file again: closing an HDF5 file after a failed write can
                # crash the process (HDF5 2.0, seen on a full disk). The file object is kept
                # alive, and with it what was flushed, which SWMR keeps readable on disk.
                _ABANDONED.append((self._f, self._ds))
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
                data = np.full((len(rows), width), _fill(c.dtype), dtype=c.dtype)
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
                    full = np.full((n, width), _fill(c.dtype), dtype=c.dtype)
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
            obj.attrs.create(k, v, dtype=_STR)
        else:
            obj.attrs[k] = v
