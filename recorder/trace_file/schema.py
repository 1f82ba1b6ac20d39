"""The trace's schema, as the recorder writes it: its format name and version, and the tables
written per step or per sample with their columns (docs/trace_format.md describes each). The
per-step tables come from torchautopsy/trace_schema.py, which the analyzer reads by too; the
others the analyzer spells on its side (analyzer/trace/; it never imports the recorder), and
tests/analyzer/test_schema_agreement.py holds the two together."""

from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np

from ... import trace_schema
# The torch.profiler range around the recorder's own work inside a profiler window: the window's
# operator table folds what runs inside it into one row of this name (profiler/profile_windows.py).
OWN_WORK_RANGE = "torchautopsy.recorder"
FORMAT_NAME, SCHEMA_VERSION = trace_schema.FORMAT_NAME, trace_schema.SCHEMA_VERSION  # (the recorder's names)

STR = h5py.string_dtype("utf-8")


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


def fill_value(dtype: str):
    return np.nan if dtype.startswith("f") else 0


# Tables written per step or per sample; each is an HDF5 group of equally long datasets.
def table_layout(n_params: int, n_modules: int, n_hist_params: int = 0, n_hist_modules: int = 0,
                 n_bins: int = 0) -> dict[str, list[Column]]:
    widths = {trace_schema.ONE: None, trace_schema.PER_PARAM: n_params, trace_schema.PER_MODULE: n_modules}

    def per_step(table: str) -> list[Column]:
        return [Column(c.name, c.dtype, widths[c.width]) for c in trace_schema.columns(table)]

    return {
        # The per-step tables (steps, params, modules): torchautopsy/trace_schema.py spells them.
        "steps": per_step("steps"),
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
        # The model's parameters each optimizer steps: rows when it is first seen and whenever its
        # groups change (add_param_group), each with the parameter's requires_grad then.
        "optimizer_params": [Column("step", "i8"), Column("optimizer", "i4"), Column("param", "i4"),
                             Column("requires_grad", "i1")],
        "params": per_step("params"),
        "modules": per_step("modules"),
        "activations": [
            Column("step", "i8"),
            Column("mean", "f4", n_modules),
            Column("std", "f4", n_modules),
            Column("absmax", "f4", n_modules),
            Column("zero_frac", "f4", n_modules),
            Column("nonfinite", "i4", n_modules),
        ],
        "updates": [Column("step", "i8"), Column("ratio", "f4", n_params)],
        # The calls of a module called more than once in a step, each a site (forward/call_sites.py),
        # appended when first seen; and their outputs on watched steps: max |output| (-1: the
        # call did not run), and mean, std, zero share on activation steps (NaN on others).
        "call_sites": [Column("module", "i4"), Column("call", "i4"), Column("first_step", "i8")],
        "call_outputs": [
            Column("step", "i8"),
            Column("output_absmax", "f4", GROWS),
            Column("mean", "f4", GROWS),
            Column("std", "f4", GROWS),
            Column("zero_frac", "f4", GROWS),
        ],
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
        # the largest groups by bytes and the most numerous (memory/readings.py).
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
        # The loss function on the first steps that went NaN/Inf (blackbox/loss_graph.py): whether the
        # model's outputs were finite on the step itself (1 NaN/Inf, 0 finite, -1 not known) and
        # the loss's autograd ops from the loss to the outputs (JSON list; null: not found).
        "loss_checks": [Column("step", "i8"), Column("outputs_nonfinite", "i1"), Column("ops", "str")],
        # The loss function's autograd ops (loss_graph.loss_ops), once: at the first step whose
        # loss reached the model's outputs (a cross-entropy: NllLossBackward0, ...).
        "loss_function": [Column("step", "i8"), Column("ops", "str")],
        # While no step comes (distributed/heartbeat.py): a row per heartbeat, what the training
        # thread was doing; its Python stack (JSON [[file, line, function, code], ...], innermost
        # last) once the step is long overdue, when it changed ("" otherwise).
        "heartbeats": [Column("time_unix", "f8"), Column("step", "i8"), Column("phase", "str"),
                       Column("phase_s", "f4"), Column("step_s", "f4"), Column("typical_step_s", "f4"),
                       Column("stack", "str")],
        # Every fingerprint_every steps, after the optimizer step: each parameter's bits summed
        # as integers (distributed/fingerprint.py); replicas (DDP) hold the same.
        "fingerprints": [Column("step", "i8"), Column("bits", "i8", n_params)],
        # torch.profiler windows (profiler/profile_windows.py); the gzipped Chrome trace of each is
        # in blobs/.
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
        # The CUDA caching allocator's snapshots (memory/cuda_allocator.py), one row each; their
        # segments, blocks and history entries in the tables below, keyed by `snapshot`. `keys`
        # columns: a bit mask of the optional keys the snapshot's dicts had (cuda_allocator.*_KEYS
        # order).
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
        # Stored tensors (blackbox/whole_tensors.py, blackbox/black_box.py): parameter snapshots,
        # sampled activations and gradients, the black box. One row per tensor; its raw bytes (exact
        # dtype, C order, little-endian) are in blobs/bytes or snapshots/bytes at [offset, offset +
        # nbytes).
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
        # Sampled histograms (reductions/histograms.py): counts per bin of histogram_bins/, for the
        # tensors listed in histogram_params/ and histogram_modules/.
        "histograms": [
            Column("step", "i8"),
            Column("weight", "i4", n_hist_params * n_bins, chunk_rows=1),
            Column("grad", "i4", n_hist_params * n_bins, chunk_rows=1),
            Column("activation", "i4", n_hist_modules * n_bins, chunk_rows=1),
        ],
    }


def chunk_rows(width: int, itemsize: int) -> int:
    # About 32 KiB per chunk (a small run stays small: each dataset holds at least one). Chunks are not compressed on purpose: HDF5 allocates an
    # uncompressed chunk once and a flush rewrites it in place, whereas a compressed chunk is
    # re-allocated at every flush that touches it and, in SWMR mode, its old space is never
    # reused (600 one-row flushes grew a 120 KB gzip dataset to 30 MB; measured).
    return int(max(16, min(4096, (32 * 1024) // max(1, width * itemsize))))


def create_column(g: h5py.Group, c: Column) -> h5py.Dataset:
    """The empty, growable dataset of a column: its dtype, fill value and chunking."""
    if c.dtype == "str":
        return g.create_dataset(c.name, shape=(0,), maxshape=(None,), dtype=STR, chunks=(256,))
    item = np.dtype(c.dtype).itemsize
    if c.width is None:  # 1,024 rows (8 KiB of int64): ~30 such columns stay small
        shape, maxshape, chunks = (0,), (None,), (1024,)
    elif c.width == GROWS:
        # 128 rows x 32 columns: a few heads or sites per layer fill a chunk's width, and
        # a short run stays one chunk tall (16 KiB for float32).
        shape, maxshape, chunks = (0, 0), (None, None), (128, 32)
    else:  # a model without parameters still gets its (steps x 0) datasets
        shape, maxshape = (0, c.width), (None, c.width or None)
        chunks = (c.chunk_rows or chunk_rows(c.width, item), max(1, c.width))
    return g.create_dataset(c.name, shape=shape, maxshape=maxshape, dtype=c.dtype, chunks=chunks,
                            fillvalue=fill_value(c.dtype))


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
