"""The Recorder: two lines in a training loop, one HDF5 file per rank."""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
import weakref

import torch
from torch import nn

from . import functional, optimizer_hooks, resume, sharding
from .activity import ActivityTracker
from .attention_capture import AttentionTracker
from .captures import Captures, check_sample_modules
from .config import RecorderConfig
from .cuda_memory import is_out_of_memory
from .exit_hooks import ExitHooks
from .grad_norms import GradientNorms
from .heartbeat import Heartbeat
from .histograms import N_BINS, histogram_tensors
from .local_grads import LocalGradients
from .hooks import ModuleWatcher
from .memory_probe import MemoryProbe
from .nan_origin import NanOrigin
from .param_stats import ParamStats
from .planner import StepPlanner
from .profiler import ProfilerWindows, own_work
from .schedule import OptimizerSchedule
from .schema import table_layout
from .step_clock import StepClock
from .step_rows import StepRows
from .trace_header import trace_header
from .writer import TraceWriter

_WRITING: dict = {}  # trace path -> weakref to the Recorder writing it in this process


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _uncompiled(model: nn.Module) -> nn.Module:
    """The model a ``torch.compile(model)`` wraps (its OptimizedModule's ``_orig_mod``: the same
    parameters, named as the user's model names them): ``Recorder(torch.compile(model))``
    records what ``Recorder(model)`` then ``torch.compile(model)`` does, the same names and hooks."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


class Recorder:
    """Records a training run into ``run_dir/rank{N}.h5``.

        rec = Recorder(model, "runs/exp1")
        for step in range(n_steps):
            ...forward, loss, optimizer.zero_grad(), loss.backward(), optimizer.step()...
            rec.step(loss=loss)      # after optimizer.step()
        rec.close()

    Options (keyword arguments) are the fields of :class:`RecorderConfig`. The recorder never
    raises into the training loop: on an internal error it warns once and stops recording,
    and the steps already flushed stay readable.
    """

    def __init__(self, model: nn.Module, run_dir, **options):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Recorder needs a torch.nn.Module, got {type(model).__name__}")
        # A GradScaler is an object, not an option: given here, or found at the first step.
        scaler = options.pop("scaler", None)
        self.config = RecorderConfig.from_kwargs(**options)
        self.model = model = _uncompiled(model)
        self.schedule = OptimizerSchedule({}, scaler)
        self._sched = (math.nan, math.nan, -1, None)  # this step's (lr, loss scale, optimizer steps, rows)
        self.run_dir = os.fspath(run_dir)
        self.rank, self.world_size = _rank_and_world()
        self.path = os.path.join(self.run_dir, f"rank{self.rank}.h5")
        other = _WRITING.get(os.path.abspath(self.path), lambda: None)()
        # (the second would pass for a restart of the first's rank): it warns, as any recorder
        # error does, and records nothing; the first keeps its file
        taken = other is not None and other._active
        if not taken:
            _WRITING[os.path.abspath(self.path)] = weakref.ref(self)
        self._step = resume.first_step(self)  # start_step=, or a resumed optimizer's count (resume.py)
        self._active = False
        self._closed = False
        self._failed_once = False
        self._lock = threading.RLock()  # reentrant: SIGTERM may land while the main thread holds it
        self.watcher = None
        self.writer = None
        self.activity = None
        self.attention = None
        self.profiler = None
        self.clock = StepClock()  # where each step's time went
        self.captures = None  # snapshots, sampled tensors, the black box (captures.py)
        self._opt_hook = None
        self.rows = None  # each step's work over the probes (step_rows.py)
        self.heartbeat = None  # what the training thread does when steps stop coming (heartbeat.py)
        self._in_step_since: float | None = None  # (the heartbeat's "recorder" phase)
        # This step has every module hooked (hooks.py); on other steps a NaN/Inf's module is
        # found by replaying the step (replay.py).
        self._watched = False
        self.origin = NanOrigin()  # where a bad step's NaN/Inf was born when not watched
        self.planner = StepPlanner(self.config)  # which step records what, within the budgets
        self.memory = MemoryProbe(self.config, self.planner, self._fail)  # RSS, CUDA, census, GC, OOM

        named = list(model.named_parameters())
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # FSDP2 (DTensor) parameters are measured by their local shard: no collective (sharding.py).
        self._grad_of = sharding.grad_getter(self._params)
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        # The gradient norms the optimizer step pre-hook takes (grad_norms.py).
        self.norms = GradientNorms(self._params, self._param_index, self._grad_of)
        self.norms.fused_option = self.config.fused_reductions  # (watch_batch.py)
        self._param_name_by_id = {id(p): n for n, p in named}
        check_sample_modules(model, self.config.sample_modules)
        try:
            self._device = self._params[0].device if self._params else torch.device("cpu")
        except Exception:
            self._device = torch.device("cpu")
        try:
            if taken:
                raise ValueError(f"another Recorder in this process records rank {self.rank} into {self.run_dir}; "
                                 "this one records nothing: give each model its own run directory")
            self._open()
        except Exception as e:
            self._fail(e)
            return
        self._exit = ExitHooks(self)  # SIGTERM and the interpreter's exit close the trace

    # -- setup --------------------------------------------------------------------------------
    def _open(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        self.watcher = ModuleWatcher(self.model, self._fail)
        self.watcher.meas.fused_option = self.config.fused_reductions
        self.watcher.inputs.fused_option = self.config.fused_reductions
        n_params, n_modules = len(self._params), len(self.watcher.names)
        cfg = self.config
        self._hist_params, hist_modules = histogram_tensors(n_params, self.watcher.is_leaf, cfg.histogram_max_tensors) \
            if cfg.histogram_every else ([], [])
        self.watcher.hist_modules = {m: k for k, m in enumerate(hist_modules)}
        attrs, static = trace_header(self.model, self._param_names, self._params, self.watcher, cfg,
                                     self.rank, self.world_size, self._device, self._hist_params, hist_modules)
        self.writer = TraceWriter(
            self.path, attrs, static,
            table_layout(n_params, n_modules, len(self._hist_params), len(hist_modules), N_BINS),
            flush_every_s=self.config.flush_every_s, write_every_steps=self.config.write_every_steps,
            queue_size=self.config.queue_size,
        )
        self.path = self.writer.path  # rank{N}.h5, or rank{N}.attempt{K}.h5 after earlier attempts
        self.activity = ActivityTracker(self.watcher, self.config.activity_window)
        self.profiler = ProfilerWindows(self.config.profile_first, self.config.profile_steps,
                                        self.config.profile_every, self._device)
        self.attention = AttentionTracker(self.watcher, self._fail)
        functional.attach(self)
        self.schedule = OptimizerSchedule(self._param_index, self.schedule.scaler)
        self.schedule.attach()
        ref = weakref.ref(self)

        def on_cuda_oom(device, alloc, device_total, device_free):  # the CUDA allocator's observer
            rec = ref()
            if rec is not None and rec._active:
                rec.memory.on_cuda_oom(rec._step, device, alloc, device_total, device_free)

        self.memory.attach(self._device, self.writer, on_cuda_oom)
        self.captures = Captures(self.model, self.watcher, cfg, self.writer, self._fail)
        if self.captures.blackbox is not None:
            self._opt_hook = optimizer_hooks.on_pre_step(self._pre_optimizer_step)
        # Gradient and weight norms, update ratios, parameter histograms (param_stats.py).
        self.param_stats = ParamStats(self._params, self._grad_of, self.norms, self.planner, self._hist_params)
        self.rows = StepRows(watcher=self.watcher, param_stats=self.param_stats, norms=self.norms,
                             activity=self.activity, attention=self.attention, origin=self.origin,
                             memory=self.memory, clock=self.clock, planner=self.planner, profiler=self.profiler,
                             captures=self.captures, schedule=self.schedule, writer=self.writer,
                             params=self._params, device=self._device)
        self.rows.fingerprint_every = cfg.fingerprint_every
        self.local_grads = self.rows.local_grads = LocalGradients(self.model)  # (DDP: each rank's own gradients)
        self._active = True
        resume.begin(self)  # the first step's schedule, profiler window and opening snapshot
        if cfg.heartbeat_s:
            self.heartbeat = Heartbeat(self, cfg.heartbeat_s, cfg.stall_factor)

    def _pre_optimizer_step(self, optimizer, args, kwargs):
        """Before any optimizer's step (a global hook): before_optimizer_step(). Not for a step
        given a closure (Lightning, LBFGS): its forward and backward run inside optimizer.step(),
        after this hook, which would judge the last step's gradients. Lightning's callback calls
        before_optimizer_step() once the closure's backward is done; elsewhere such a step's
        gradients are measured at rec.step(), and a NaN in them fires the black box there."""
        if callable(kwargs.get("closure", args[0] if args else None)):
            return None
        self.before_optimizer_step(optimizer)
        return None

    def keep_step_call(self, method: str, args: tuple, shared: dict | None = None) -> None:
        """For a framework's callback: the step's own entry into the model (Lightning's
        ``training_step`` and its batch), which the black box keeps and a replay runs
        (blackbox.BlackBox.keep_step_call)."""
        if not self._active or self.captures is None or self.captures.blackbox is None:
            return
        try:
            self.captures.blackbox.keep_step_call(method, args, shared)
        except Exception as e:  # never into the training
            self._fail(e)

    def before_optimizer_step(self, optimizer) -> None:
        """Call after the step's backward, before ``optimizer.step()`` updates the parameters,
        where the global optimizer hook cannot: an optimizer stepped with a closure (Lightning's
        callback calls it; a loop of its own calls it at the end of its closure). Computes the
        gradient norms rec.step() records (once, here, reused there) and, if one is NaN/Inf,
        fires the black box while the parameters are still those the bad step started from.
        Optimizers of other models are ignored, and so are gradients judged already this step
        (the global hook after a call here)."""
        if not self._active or not self.captures.armed:
            return None
        try:
            with own_work():
                bad = self.norms.judge(optimizer, self._step)
                if bad:  # NaN/Inf gradients, not yet applied: the black box now
                    names = [self._param_names[i] for i in bad]
                    extra = {"n_params_affected": len(names), **self._replay()}
                    bb = self.captures.blackbox
                    self.captures.fire(bb.capture(self._step, "grad_nonfinite", "start_of_step", optimizer, names,
                                                  self._param_name_by_id, extra))
        except Exception as e:
            self._fail(e)
        return None

    def _replay(self) -> dict:
        """On a step that was not watched (or whose compiled forward hid its inner modules), find
        where its NaN/Inf was born by running its forward passes again on a copy of the model
        (before the black box is written: it says how it went)."""
        return {} if self._watched and not self.watcher.compiled else self.origin.replay(self.captures.blackbox)

    def _set_schedule(self, step: int) -> None:
        """Tell the hooks what the coming step records, and hook every module if it records
        anything per module (a watched step; other steps hook only the root, see hooks.py)."""
        w = self.watcher
        w.sample_activations = self.attention.sampled = step >= self.planner.next_watch
        w.sample_histograms = bool(self.config.histogram_every) and step == self.planner.next_hist
        samples, bb = self.captures.samples, self.captures.blackbox
        w.sample_tensors = samples is not None and samples.due(step)
        self._watched = w.sample_activations or w.sample_histograms or w.sample_tensors
        w.inputs.watched = self._watched  # (the batch's zero share and constant features too)
        if self._watched or w.watching:  # (from one plain step to the next nothing changes)
            w.watch(self._watched)
            functional.watching(self, self._watched)
            if bb is not None:  # watched steps read the RNG states and check them
                bb.take_rng = self._watched or not bb.rng_free
        self.origin.new_step()
        self.activity.step = self.attention.step = step

    # -- observer of wrapped functions (functional.py) ---------------------------------------
    def on_activation(self, fn, args, kwargs, out) -> None:
        if self._active:
            with own_work():
                self.activity.on_activation(fn, args, kwargs, out)

    def on_attention(self, fn, args, kwargs, out) -> None:
        if self._active:
            with own_work():
                self.attention.on_attention(fn, args, kwargs, out)

    def on_data_wait(self, seconds: float) -> None:
        if self._active:
            self.clock.on_data_wait(seconds)

    def on_observer_error(self, e: BaseException) -> None:
        self._fail(e)

    # -- per step -----------------------------------------------------------------------------
    def step(self, loss=None) -> None:
        """Mark the end of one training iteration (call it after ``optimizer.step()``)."""
        if self._active:
            if self._watched:  # (counted once the step has run: the activity window holds it)
                self.activity.steps_watched += 1
            try:
                t_called = self._in_step_since = time.perf_counter()
                with own_work():
                    self._sched = self.schedule.end_step(self._step)
                    if not self.rows.plain(self._step, loss, t_called, self._watched, self._sched):
                        self.rows.record(self._step, loss, t_called, self._watched, self._sched)
            except Exception as e:
                self._fail(e)
            self._in_step_since = None
            self.norms.entries = []
            self.norms.kept = -1
            if self.local_grads.due and self._active:  # (after the job's first backward: local_grads.py)
                self.local_grads.attach()
        if self._active:
            w = self.watcher
            self.planner.after_step(self._step, self._watched, w.sample_activations, w.sample_histograms)
        self._step += 1
        if self._active:
            self._set_schedule(self._step)
            try:
                self.profiler.begin(self._step)
            except Exception as e:
                self._fail(e)
        if self.writer is not None and self.writer.error is not None and self._active:
            self._fail(self.writer.error)

    # -- errors and shutdown ------------------------------------------------------------------
    def _fail(self, e: BaseException) -> None:
        """Warn once, unhook, stop recording; never raise into the training job."""
        with self._lock:
            if self._failed_once:
                return
            self._failed_once = True
            self._active = False
        if self.writer is None or e is not self.writer.error:  # the writer warned already
            warnings.warn(
                f"torchautopsy: recorder error ({type(e).__name__}: {e}); recording stopped, training "
                f"goes on; steps recorded before this are in {self.path}", RuntimeWarning, stacklevel=2,
            )
        try:
            self._unhook()
            if self.writer is not None:
                self.writer.close({"closed": True, "end_reason": f"recorder error: {type(e).__name__}: {e}"[:1000],
                                   "n_steps_recorded": self._step})
        except Exception:
            pass

    def _unhook(self) -> None:
        if getattr(self, "heartbeat", None) is not None:
            self.heartbeat.stop()
        if getattr(self, "local_grads", None) is not None:
            self.local_grads.stop()
        self.schedule.remove()
        if getattr(self, "_opt_hook", None) is not None:
            self._opt_hook.remove()
            self._opt_hook = None
        if getattr(self, "captures", None) is not None:
            self.captures.remove()
        if getattr(self, "profiler", None) is not None:
            self.profiler.abort()
        functional.detach(self)
        if getattr(self, "memory", None) is not None:
            self.memory.detach()
        if self.attention is not None:
            self.attention.remove()
        if self.watcher is not None:
            self.watcher.remove()

    def flush(self) -> None:
        """Write everything recorded so far to disk now."""
        if self._active and self.writer is not None:
            self.writer.flush()

    def close(self, reason: str = "closed") -> None:
        """Flush, unhook and close the trace. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            was_active = self._active
            self._active = False
        try:
            if was_active:
                rows = self.activity.final_rows(self._step - 1)
                if rows is not None:
                    self.writer.put(rows)
                self.captures.at_close(self._step, reason)
            self._unhook()
            if was_active and self.writer is not None:
                self.writer.close({
                    "closed": True, "end_reason": reason, "end_unix": time.time(),
                    "n_steps_recorded": self._step, "local_grad_norms": self.local_grads.status,
                    **self.captures.note(),
                    **(self.profiler.note() if self.profiler is not None else {}),
                })
            if getattr(self, "param_stats", None) is not None:
                self.param_stats.release()
        except Exception as e:
            warnings.warn(f"torchautopsy: closing the trace failed ({e!r})", RuntimeWarning, stacklevel=2)
        if getattr(self, "_exit", None) is not None:
            self._exit.remove()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self._on_error_leaving(exc, tb)
        self.close(reason="closed" if exc_type is None else f"exception: {exc_type.__name__}: {exc}"[:1000])
        return False

    def _on_error_leaving(self, exc: BaseException, tb) -> None:
        """An error ends the job: if it is out of memory, record what held the memory."""
        if is_out_of_memory(exc) and self._active:
            self.memory.on_oom_exception(self._step, self.rows.device if self.rows else self._device, exc, tb)
