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

from .blackbox.captures import Captures, check_sample_modules
from .blackbox.nan_origin import NanOrigin
from .config import RecorderConfig
from .distributed import sharding
from .distributed.fingerprint import Fingerprints
from .distributed.heartbeat import Heartbeat, phase_of
from .distributed.local_grads import LocalGradients
from .forward import wrapped_functions
from .forward.attention_capture import AttentionTracker
from .forward.input_stats import InputStats
from .forward.module_watcher import ModuleWatcher
from .forward.root_hooks import RootHooks, TrainMode
from .forward.step_time import StepClock
from .forward.unit_activity import ActivityTracker
from .memory.cuda_allocator import is_out_of_memory
from .memory.memory_probe import MemoryProbe
from .optimizer.grad_norms import GradientNorms
from .optimizer.param_stats import ParamStats
from .optimizer.schedule import OptimizerSchedule
from .optimizer.update_guard import UpdateGuard
from .planner import StepPlanner
from .probe import Probe, StepPlan, plan as make_plan
from .profiler.profile_windows import ProfilerWindows, own_work
from .reductions.histograms import N_BINS, histogram_tensors
from .step_rows import StepRows
from .trace_file import attempts
from .trace_file.exit_hooks import ExitHooks
from .trace_file.header import trace_header
from .trace_file.schema import table_layout
from .trace_file.writer import TraceWriter

_WRITING: dict = {}  # trace path -> weakref to the Recorder writing it in this process


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
        self.rank, self.world_size = sharding.rank_and_world()
        self.path = os.path.join(self.run_dir, f"rank{self.rank}.h5")
        other = _WRITING.get(os.path.abspath(self.path), lambda: None)()
        # (the second would pass for a restart of the first's rank): it warns, as any recorder
        # error does, and records nothing; the first keeps its file
        taken = other is not None and other._active
        if not taken:
            _WRITING[os.path.abspath(self.path)] = weakref.ref(self)
        start = self.config.start_step  # or, on a restart, a resumed optimizer's count (trace_file/attempts.py)
        self._start = attempts.StartStep(start, start is None and attempts.restarted(self.run_dir, self.rank))
        self._step = self._start.start
        self._plan = StepPlan(self._step)  # what the coming step records (_arm)
        self._probes: tuple = ()  # armed before each step, aligned on a resume, closed (probe.py)
        self._armed: tuple = ()  # those of them that arm
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
        self.train_mode = TrainMode()  # the model's mode at its forward passes
        self.root_hooks = None  # the root module's hooks of every step (forward/root_hooks.py)
        self.captures = None  # snapshots, sampled tensors, the black box (blackbox/captures.py)
        self._guard = None  # the gradients judged before each optimizer step (optimizer/update_guard.py)
        self.rows = None  # each step's work over the probes (step_rows.py)
        self.heartbeat = None  # what the training thread does when steps stop coming (distributed/heartbeat.py)
        self._in_step_since: float | None = None  # (the heartbeat's "recorder" phase)
        # This step has every module hooked (forward/module_watcher.py); on other steps a NaN/Inf's
        # module is found by replaying the step (blackbox/replay.py).
        self._watched = False
        # What the wrapped functions show the recorder (forward/wrapped_functions.py)
        self._observer = wrapped_functions.Observer(self._on_activation, self._on_attention, self._on_data_wait,
                                                    self._fail)
        self.origin = NanOrigin()  # where a bad step's NaN/Inf was born when not watched
        self.planner = StepPlanner(self.config)  # which step records what, within the budgets
        self.memory = MemoryProbe(self.config, self.planner, self._fail)  # RSS, CUDA, census, GC, OOM

        named = list(model.named_parameters())
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        # FSDP2 (DTensor) parameters are measured by their local shard: no collective (distributed/sharding.py).
        self._grad_of = sharding.grad_getter(self._params)
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        # The gradient norms the optimizer step pre-hook takes (optimizer/grad_norms.py).
        self.norms = GradientNorms(self._params, self._param_index, self._grad_of, self.config.fused_reductions)
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
        # SIGTERM and the interpreter's exit close the trace
        self._exit = ExitHooks(self.close, self._on_error_leaving, self.config.handle_sigterm)

    # -- setup --------------------------------------------------------------------------------
    def _open(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        cfg = self.config
        self.watcher = ModuleWatcher(self.model, self._fail, cfg.fused_reductions)
        self.inputs = InputStats(cfg.fused_reductions)  # the batch's statistics
        self.root_hooks = RootHooks(self.model, self.clock, self.train_mode, self.inputs, self.origin, self._fail)
        n_params, n_modules = len(self._params), len(self.watcher.names)
        self._hist_params, hist_modules = histogram_tensors(n_params, self.watcher.is_leaf, cfg.histogram_max_tensors) \
            if cfg.histogram_every else ([], [])
        self.watcher.histogram_modules(hist_modules)
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
        wrapped_functions.attach(self._observer)
        self.schedule = OptimizerSchedule(self._param_index, self.schedule.scaler)
        self.schedule.attach()
        ref = weakref.ref(self)

        def on_cuda_oom(device, alloc, device_total, device_free):  # the CUDA allocator's observer
            rec = ref()
            if rec is not None and rec._active:
                rec.memory.on_cuda_oom(rec._step, device, alloc, device_total, device_free)

        self.memory.attach(self._device, self.writer, on_cuda_oom)
        self.captures = Captures(self.model, self.watcher, cfg, self.writer, self._fail)
        self._guard = UpdateGuard(self.norms, self.captures, self.origin, self.watcher, self._param_names,
                                  self._param_name_by_id, step_now=lambda: self._step, active=lambda: self._active,
                                  watched=lambda: self._watched, fail=self._fail)
        # Gradient and weight norms, update ratios, parameter histograms (optimizer/param_stats.py).
        self.param_stats = ParamStats(self._params, self._grad_of, self.norms, self.planner, self._hist_params)
        self.local_grads = LocalGradients(self.model)  # (DDP: each rank's own gradients)
        fingerprints = Fingerprints(self._params, cfg.fingerprint_every)
        self.rows = StepRows(watcher=self.watcher, param_stats=self.param_stats, norms=self.norms,
                             activity=self.activity, attention=self.attention, origin=self.origin,
                             inputs=self.inputs, local_grads=self.local_grads, fingerprints=fingerprints,
                             mode=self.train_mode, memory=self.memory, clock=self.clock, planner=self.planner,
                             profiler=self.profiler, captures=self.captures, schedule=self.schedule,
                             writer=self.writer, params=self._params, device=self._device)
        # In the order they are armed: the profiler's window opens last, once the step is set up.
        self._probes = (self.watcher, self.inputs, self.attention, self.activity, self.origin, self.norms,
                        self.captures, self.param_stats, fingerprints, self.local_grads, self.memory, self.profiler)
        self._armed = tuple(p for p in self._probes if type(p).arm is not Probe.arm)  # (every step: no no-ops)
        self._active = True
        self._begin()
        if cfg.heartbeat_s:
            clock = self.clock
            self.heartbeat = Heartbeat(step_now=lambda: self._step, active=lambda: self._active,
                                       phase=lambda: phase_of(self._in_step_since, clock),
                                       step_began=lambda: clock.t_step_end, put_task=self.writer.put_task,
                                       every_s=cfg.heartbeat_s, stall_factor=cfg.stall_factor)

    def _begin(self) -> None:
        """The first step's plan and profiler window, and the opening snapshot (the parameters
        at the start of the first step; held back until its number is known on a restart)."""
        s, start = self._step, self._start
        if s:
            self._align(s)
        self._arm(s)
        held = self.captures.opening_snapshot(s, known=not start.auto)
        if start.auto:
            start.search(self._param_index, held, is_first=lambda: self._active and self._step == start.start,
                         resume_at=self._resume_at, hand_over=self._hand_over)

    def _align(self, s: int) -> None:
        """Schedules that count from step 0 start from step s instead (the start of a resumed
        attempt, as step 0 is of a run): the first update ratio at s + 1, against a copy taken at
        the end of step s (one taken when the Recorder opened may predate the checkpoint)."""
        self.planner.align(s)
        for probe in self._probes:
            probe.align(s)
        self.writer.align(s)

    def _resume_at(self, s: int, held: bool) -> None:
        """The optimizer restored s steps: this iteration, the first recorded, is step s."""
        self._step = s
        self._plan = self._plan._replace(step=s)  # (what it records was decided already)
        self._align(s)
        self.captures.resumed_at(s, held)

    def _hand_over(self, task) -> None:
        if self.writer is not None and self._active:
            self.writer.put_task(task)

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
        if self._guard is not None:
            self._guard.judge(optimizer)

    def _arm(self, step: int) -> None:
        """Decide what the coming step records (the planner's budgets) and arm every probe with it;
        every module is hooked if it records anything per module (a watched step; other steps
        hook only the root, see forward/module_watcher.py)."""
        planner, samples = self.planner, self.captures.samples
        plan = self._plan = make_plan(step, step >= planner.next_watch,
                                      bool(self.config.histogram_every) and step == planner.next_hist,
                                      samples is not None and samples.due(step))
        watched = plan.watched
        if watched or self._watched:  # (from one plain step to the next nothing changes)
            wrapped_functions.watching(self._observer, watched)
        self._watched = watched
        try:
            for probe in self._armed:
                probe.arm(plan)
        except Exception as e:
            self._fail(e)

    # -- observer of wrapped functions (forward/wrapped_functions.py) -------------------------
    def _on_activation(self, fn, args, kwargs, out) -> None:
        if self._active:
            with own_work():
                self.activity.on_activation(fn, args, kwargs, out)

    def _on_attention(self, fn, args, kwargs, out) -> None:
        if self._active:
            with own_work():
                self.attention.on_attention(fn, args, kwargs, out)

    def _on_data_wait(self, seconds: float) -> None:
        if self._active:
            self.clock.on_data_wait(seconds)

    # -- per step -----------------------------------------------------------------------------
    def step(self, loss=None) -> None:
        """Mark the end of one training iteration (call it after ``optimizer.step()``)."""
        if self._start.pending:  # (a restart: the search for its first step's number ends)
            self._start.finish(self._fail)
        plan = self._plan
        if self._active:
            try:
                t_called = self._in_step_since = time.perf_counter()
                with own_work():
                    self._sched = self.schedule.end_step(self._step)
                    if not self.rows.plain(plan, loss, t_called, self._sched):
                        self.rows.record(plan, loss, t_called, self._sched)
            except Exception as e:
                self._fail(e)
            self._in_step_since = None
            if self.local_grads.due and self._active:  # (after the job's first backward: distributed/local_grads.py)
                self.local_grads.attach()
        if self._active:
            self.planner.after_step(self._step, plan.watched, plan.activations, plan.histograms)
        self._step += 1
        if self._active:
            self._arm(self._step)
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
        self.schedule.remove()
        if getattr(self, "_guard", None) is not None:
            self._guard.remove()
        wrapped_functions.detach(self._observer)
        if getattr(self, "root_hooks", None) is not None:
            self.root_hooks.remove()
        # (_open may have failed before the probes were listed: those it made)
        made = (self.watcher, self.attention, self.profiler, self.captures, self.memory)
        for probe in self._probes or [p for p in made if p is not None]:
            probe.close()

    def flush(self) -> None:
        """Write everything recorded so far to disk now."""
        if self._active and self.writer is not None:
            self.writer.flush()

    def close(self, reason: str = "closed") -> None:
        """Flush, unhook and close the trace. Safe to call more than once."""
        if self._start.pending:
            self._start.finish(self._fail)
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
