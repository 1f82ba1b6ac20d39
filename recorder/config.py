"""What the recorder records and how often. The defaults are meant to be left alone."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass


@dataclass(frozen=True)
class RecorderConfig:
    # Watched steps: every module is hooked (recorder/forward/module_watcher.py) for its output's finite check and
    # max |x|, activation statistics (mean, std, zero share) and per-unit activity, and attention
    # statistics. Other steps hook only the root module: a NaN/Inf is still seen on its step (loss
    # and gradient norms), and its module found by replaying the step (recorder/blackbox/replay.py).
    # Every `activations_every`-th step (or `attention_every`-th, the smaller) in the first
    # `watch_warmup` steps; then as often as that allows, but sparser if watched steps would add
    # more than `watch_budget` of the training time, though never sparser than one per activity
    # window. A watched step costs a few passes over each activation and some Python per module
    # (what that is on the benchmarks' models: benchmarks/README.md, "What the defaults cost"), so
    # a small CPU model is watched about every 50th step, one per activity window; a large model
    # on a GPU stays at every 10th. watch_budget=1 keeps the fixed schedule.
    activations_every: int = 10
    watch_budget: float = 0.003
    watch_warmup: int = 100
    # How a watched step reduces what it measures: None (on a GPU, a fixed number of foreach ops
    # for all modules at once, a kernel launch being what a launch-bound step pays; on the CPU,
    # per tensor, faster there), True (fused anywhere: how benchmarks/op_counts.py counts the GPU's
    # ops on the CPU), False (per tensor anywhere). See recorder/reductions/fused.py.
    fused_reductions: bool | None = None
    # Update-to-weight ratio ||w_after - w_before|| / ||w_before||. It needs a copy of the
    # weights taken one step earlier, so it is sampled: every `update_ratio_every`-th step in the
    # first `watch_warmup` steps, then as often as that allows, but sparser (a multiple of it, at
    # most 10 times it) if the two steps of a sample would add more than `update_ratio_budget` of
    # the training time. A sample costs a copy and two passes over the weights and two recorded
    # steps. update_ratio_budget=1 keeps the fixed schedule unless a sample costs more than
    # update_ratio_every plain steps.
    update_ratio_every: int = 10
    update_ratio_budget: float = 0.0015
    # Per-unit activity of ReLU-family/GELU outputs (dead units) and saturation of tanh/sigmoid
    # are accumulated on the device every step and written once per window: windows of 5, 10,
    # 20 and 40 steps first (deaths early in training are dated closely), then of this many.
    # 50 steps: a unit that fired once in 50 batches is alive; 1,000 steps give ~20 windows.
    activity_window: int = 50
    # Attention entropy/max weight/sink share per head, on watched steps (each costs a second
    # softmax over a 4-sequence slice of the batch).
    attention_every: int = 10
    # Census of live tensors (count, bytes, how many hold an autograd graph) through the garbage
    # collector's object list: every 50 steps at most, and less often if a census would take more
    # than census_budget of the training time. It reads every object Python tracks (a process
    # that imported torch has hundreds of thousands), so jobs of short steps take one rarely.
    # Memory climbing to a new high takes one too (memory/memory_probe.py).
    census_every: int = 50
    # Share of the training time the census may take; sparser than census_every if needed.
    census_budget: float = 0.0015
    # torch.profiler windows of `profile_steps` steps: the first at step `profile_first` (after
    # warm-up), then every `profile_every` steps. A window costs what the profiler costs on its
    # steps (more with memory and shapes recorded), so 2 steps every 1,000 cost little. Two steps
    # show a steady-state step and the boundary between steps. profile_steps=0 turns them off.
    profile_first: int = 10
    profile_steps: int = 2
    profile_every: int = 1000
    # CUDA only: the caching allocator's own record (memory/cuda_allocator.py). Its history of allocations
    # and frees (torch.cuda.memory._record_memory_history, Python stacks, kept for allocations
    # only) is bounded to this many events: PyTorch documents each as up to several KB of host
    # memory, so 10,000 keep it to tens of MB while covering a few steps of a large model. A job
    # that records a history itself keeps its own. False: no history (snapshots then show blocks
    # without stacks).
    cuda_memory_history: bool = True
    cuda_history_entries: int = 10_000
    # Snapshots of the allocator (torch.cuda.memory._snapshot(), converted to tables, no pickle):
    # at step `cuda_snapshot_first`, then every `cuda_snapshot_every` steps (0: none on a
    # schedule), when memory climbs to a new high (with the census), and when memory runs out.
    # At most `cuda_snapshot_max` on a schedule and at peaks (each holds up to
    # cuda_history_entries history rows, ~0.5 MB).
    cuda_snapshot_first: int = 10
    cuda_snapshot_every: int = 1000
    cuda_snapshot_max: int = 50
    # Many-rank jobs. The heartbeat (distributed/heartbeat.py): a thread that wakes every `heartbeat_s`
    # seconds and, only when no step came since, writes what the training thread is doing (step,
    # phase), with its Python stack once the step has taken `stall_factor` times the usual step:
    # a hung job killed by a timeout still says where each rank stopped. 0: no heartbeat.
    heartbeat_s: float = 5.0
    stall_factor: float = 10.0
    # Replica fingerprints (distributed/fingerprint.py): every `fingerprint_every` steps, each parameter's
    # bits summed as integers, one reduction per parameter (a transformer of 200 tensors: ~400
    # ops every 100th step, 0.2% of its ops; counted by benchmarks/op_counts.py), so that the
    # analyzer can name the step and rank where a data-parallel replica left the others. 0: off.
    fingerprint_every: int = 100
    # The writer thread writes and flushes the file at least this often (seconds). A job killed
    # by SIGKILL loses at most this much.
    flush_every_s: float = 5.0
    # Rows the writer keeps in memory before it writes them out, whatever the time.
    write_every_steps: int = 256
    # Bound of the queue between the training thread and the writer thread; when full, rows are
    # dropped (and counted) rather than stalling training.
    queue_size: int = 1024
    # Flush and close the trace on SIGTERM (cluster pre-emption), then let the signal go on.
    handle_sigterm: bool = True
    # The number of the first rec.step() of this Recorder: a job restarted from a checkpoint
    # passes the step it resumes at, so that its steps line up with the earlier attempt's (each
    # attempt writes its own file, rank{N}.attempt{K}.h5 after rank{N}.h5; recorder/trace_file/attempts.py).
    # None: 0 for a first attempt; on a restart (an earlier attempt's trace is in run_dir), the
    # step count an optimizer of the model restored from its checkpoint, read at its first step
    # (Adam, AdamW, RMSprop, Adagrad... keep one, SGD does not), else 0.
    start_step: int | None = None
    # Parameter snapshots (parameters and persistent buffers, keys as in model.state_dict()): the
    # weights at step 0, then at the start of every `snapshot_every`-th step, and the final ones at
    # close. Each costs one copy of the model to the host (on CUDA a sync) on its step only: every
    # 1,000 steps that is far below 0.1% of a job whose step takes 10 ms or more. 0 turns them off.
    snapshot_every: int = 1000
    # Disk the snapshots may take: the first snapshot is always kept, later ones reuse the slots
    # of a ring (the oldest goes first), so a trace never grows past this with snapshots. 1 GiB
    # keeps ~25 snapshots of a 10M-parameter float32 model; a model larger than the budget gets
    # none (say so with a larger budget, or snapshot_dtype="bfloat16").
    snapshot_budget_bytes: int = 2**30
    # "exact" stores every tensor in its own dtype (bfloat16 as its raw bits); "float16" or
    # "bfloat16" halve a float32 model's snapshots (integer buffers stay exact).
    snapshot_dtype: str = "exact"
    # Fixed-bin histograms (NaN, -Inf, signed half-octave magnitudes from 2**-40 to 2**8, zero,
    # +Inf: 196 bins, the same at every step; recorder/reductions/histograms.py) of weights, gradients and
    # leaf-module outputs. Every `histogram_every`-th step in the first `watch_warmup` steps, then
    # as often as that allows, but sparser (a multiple of it, at most 10 times it) if histogram
    # steps would add more than `histogram_budget` of the training time. Such a step hooks every
    # module and makes a shift and a bincount over each tensor, so a small CPU model's steps
    # are spaced wider; a model whose steps are long against its size keeps every 100th. 196 x 4
    # bytes per tensor per sample. 0: off; histogram_budget=1 keeps every histogram_every-th step
    # unless one costs more than histogram_every plain steps.
    histogram_every: int = 100
    histogram_budget: float = 0.001
    # Tensors histogrammed per kind (weights/gradients, module outputs) at most, spread evenly
    # over the model's depth when it has more: bounds the bytes of a very deep model.
    histogram_max_tensors: int = 128
    # Whole activations and output gradients of a few modules (`sample_modules`, by
    # named_modules() name; default: the first, middle and last leaf modules with weights), every
    # `sample_every` steps: the first `sample_rows` rows of the batch (dim 0), at most
    # `sample_max_elements` elements each (64 KiB of float32), `sample_budget_bytes` in all (then
    # sampling stops). Every 500 steps: ~0.4 MB per sample step for three layers at most,
    # under 1 KB per step. 0 turns them off.
    sample_every: int = 500
    sample_modules: tuple | None = None
    sample_rows: int = 4
    sample_max_elements: int = 16384
    sample_budget_bytes: int = 256 * 2**20
    # The black box: the first time the loss, a gradient or a module output goes NaN/Inf (and on
    # an exception leaving a `with Recorder(...)` block or the script, or on SIGTERM), the trace
    # gets the parameters and buffers as they were before the bad update, the inputs of that
    # step's forward passes, the gradients and optimizer state of the affected parameters, and
    # the RNG states (torch's at the step's first forward). Until then it copies nothing but the
    # buffers. Its cost per step:
    # - memory: references to the model's forward inputs, released at rec.step(): no more than
    #   the loop holds anyway (one batch), and one device copy of the persistent buffers
    #   (BatchNorm statistics: their values at the step's first forward; a few KB usually);
    # - time: a forward pre-hook (torch's RNG state, a foreach copy of the buffers), and in an
    #   optimizer step pre-hook the gradient norms rec.step() records anyway, computed there
    #   instead (before the update) plus an isfinite check and one host sync.
    # When it fires (once): one host copy of the model, the batch, the gradients and optimizer
    # state of the affected parameters (all of them after a NaN loss; Adam keeps 2 tensors per
    # parameter), written and flushed before the update goes on. Without an optimizer step (a hand-written update) it fires at
    # rec.step(), with the parameters after that update. False turns it off.
    blackbox: bool = True

    def __post_init__(self):
        for f in ("activations_every", "update_ratio_every", "write_every_steps", "queue_size",
                  "activity_window", "attention_every", "census_every", "profile_every"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Recorder option {f} must be a positive integer, got {v!r}")
        if not isinstance(self.cuda_memory_history, bool):
            raise ValueError(f"Recorder option cuda_memory_history must be True or False, got {self.cuda_memory_history!r}")
        if not isinstance(self.cuda_history_entries, int) or self.cuda_history_entries < 1:
            raise ValueError("Recorder option cuda_history_entries must be a positive integer, got "
                             f"{self.cuda_history_entries!r}")
        for f in ("profile_first", "profile_steps", "cuda_snapshot_first", "cuda_snapshot_every", "cuda_snapshot_max"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 0:
                raise ValueError(f"Recorder option {f} must be an integer >= 0, got {getattr(self, f)!r}")
        if self.fused_reductions not in (None, True, False):
            raise ValueError(f"Recorder option fused_reductions must be None, True or False, got {self.fused_reductions!r}")
        if not 0 < self.watch_budget <= 1:
            raise ValueError(f"Recorder option watch_budget must be in (0, 1], got {self.watch_budget!r}")
        if not isinstance(self.watch_warmup, int) or self.watch_warmup < 0:
            raise ValueError(f"Recorder option watch_warmup must be an integer >= 0, got {self.watch_warmup!r}")
        if not 0 < self.update_ratio_budget <= 1:
            raise ValueError(f"Recorder option update_ratio_budget must be in (0, 1], got {self.update_ratio_budget!r}")
        if not 0 < self.histogram_budget <= 1:
            raise ValueError(f"Recorder option histogram_budget must be in (0, 1], got {self.histogram_budget!r}")
        if not 0 < self.census_budget <= 1:
            raise ValueError(f"Recorder option census_budget must be in (0, 1], got {self.census_budget!r}")
        for f in ("snapshot_every", "histogram_every", "sample_every", "snapshot_budget_bytes",
                  "sample_budget_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Recorder option {f} must be an integer >= 0 (0: off), got {v!r}")
        for f in ("histogram_max_tensors", "sample_rows", "sample_max_elements"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Recorder option {f} must be a positive integer, got {v!r}")
        if self.snapshot_dtype not in ("exact", "float16", "bfloat16"):
            raise ValueError(f"Recorder option snapshot_dtype must be 'exact', 'float16' or 'bfloat16', "
                             f"got {self.snapshot_dtype!r}")
        if self.sample_modules is not None:
            mods = (self.sample_modules,) if isinstance(self.sample_modules, str) else self.sample_modules
            if not all(isinstance(m, str) for m in mods):
                raise ValueError(f"Recorder option sample_modules must be module names, got {self.sample_modules!r}")
            object.__setattr__(self, "sample_modules", tuple(mods))
        if self.start_step is not None:
            try:  # (a numpy or 0-d tensor integer read from a checkpoint is taken as a plain int)
                start = None if isinstance(self.start_step, bool) else operator.index(self.start_step)
            except TypeError:
                start = None
            if start is None or start < 0:
                raise ValueError(f"Recorder option start_step must be an integer >= 0 (or None: from the "
                                 f"optimizer's state), got {self.start_step!r}")
            object.__setattr__(self, "start_step", start)
        if not (isinstance(self.fingerprint_every, int) and not isinstance(self.fingerprint_every, bool)
                and self.fingerprint_every >= 0):
            raise ValueError(f"Recorder option fingerprint_every must be an integer >= 0 (0: off), "
                             f"got {self.fingerprint_every!r}")
        if not (isinstance(self.heartbeat_s, (int, float)) and self.heartbeat_s >= 0):
            raise ValueError(f"Recorder option heartbeat_s must be seconds >= 0 (0: off), got {self.heartbeat_s!r}")
        if not (isinstance(self.stall_factor, (int, float)) and self.stall_factor >= 1):
            raise ValueError(f"Recorder option stall_factor must be a number >= 1, got {self.stall_factor!r}")
        if not self.flush_every_s > 0:
            raise ValueError(f"Recorder option flush_every_s must be > 0, got {self.flush_every_s!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "RecorderConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"Recorder got unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        return cls(**kwargs)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
