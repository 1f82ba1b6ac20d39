"""The Recorder: two lines in a training loop, one HDF5 file per rank."""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
import weakref

import numpy as np
import torch
from torch import nn

from . import functional, optimizer_hooks, resume, sharding
from .activity import ActivityTracker
from .attention_capture import AttentionTracker
from .blackbox import BlackBox
from .config import RecorderConfig
from .cuda_memory import is_out_of_memory
from .exit_hooks import ExitHooks
from .grad_norms import GradientNorms
from .histograms import N_BINS, spread
from .hooks import ModuleWatcher
from .memory_probe import MemoryProbe
from .nan_origin import NanOrigin, loss_is_bad
from .param_stats import ParamStats
from .planner import StepPlanner
from .profiler import ProfilerWindows
from .schedule import OptimizerSchedule
from .schema import table_layout
from .stats import Packer
from .tensors import Samples, Snapshots
from .trace_header import trace_header
from .writer import TraceWriter

_WRITING: dict = {}  # trace path -> weakref to the Recorder writing it in this process


def _rank_and_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Recorder:
    """Records a training run into ``run_dir/rank{N}.h5``.

        rec = Recorder(model, "runs/exp1")
        for step in range(n_steps):
            ...forward, loss, optimizer.zero_grad(), loss.backward(), optimizer.step()...
            rec.step(loss=loss)      # after optimizer.step(), before the next zero_grad()
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
        self.model = model
        self.schedule = OptimizerSchedule({}, scaler)
        self._sched = (math.nan, math.nan, -1, None)  # this step's (lr, loss scale, optimizer steps, rows)
        self.run_dir = os.fspath(run_dir)
        self.rank, self.world_size = _rank_and_world()
        self.path = os.path.join(self.run_dir, f"rank{self.rank}.h5")
        other = _WRITING.get(os.path.abspath(self.path), lambda: None)()
        if other is not None and other._active:  # (the second would pass for a restart of the first's rank)
            raise ValueError(f"another Recorder in this process records rank {self.rank} into {self.run_dir}: "
                             "give each model its own run directory")
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
        self._t_step_end: float | None = None
        self._data_wait_s = 0.0  # time in DataLoader.__next__ since the last rec.step()
        self._saw_loader = False
        self.snapshots = None
        self.samples = None
        self.blackbox = None
        self._opt_hook = None
        self._last_snapshot = -1
        self._loss_given = False
        # This step has every module hooked (hooks.py); on other steps a NaN/Inf's module is
        # found by replaying the step (replay.py), whose watcher row is kept here for rec.step().
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
        self._param_name_by_id = {id(p): n for n, p in named}
        if self.config.sample_modules is not None:
            known = {n for n, _ in model.named_modules()}
            unknown = [m for m in self.config.sample_modules if m not in known]
            if unknown:
                raise ValueError(f"Recorder option sample_modules: no module named {', '.join(map(repr, unknown))} "
                                 f"in the model (names as model.named_modules() spells them)")
        try:
            self._device = self._params[0].device if self._params else torch.device("cpu")
        except Exception:
            self._device = torch.device("cpu")
        try:
            self._open()
        except Exception as e:
            self._fail(e)
            return
        # Gradient and weight norms, update ratios, parameter histograms (param_stats.py).
        self.param_stats = ParamStats(self._params, self._grad_of, self.norms, self.planner, self._hist_params)
        self._exit = ExitHooks(self)  # SIGTERM and the interpreter's exit close the trace

    # -- setup --------------------------------------------------------------------------------
    def _open(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        self.watcher = ModuleWatcher(self.model, self._fail)
        n_params, n_modules = len(self._params), len(self.watcher.names)
        cfg = self.config
        # Histograms: every parameter and leaf module, or an even spread of at most
        # histogram_max_tensors of each over the model's depth.
        self._hist_params = spread(n_params, cfg.histogram_max_tensors) if cfg.histogram_every else []
        leaves = [i for i, leaf in enumerate(self.watcher.is_leaf) if leaf and i > 0 or n_modules == 1]
        hist_modules = [leaves[k] for k in spread(len(leaves), cfg.histogram_max_tensors)] if cfg.histogram_every else []
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
        # A step without module hooks: output_absmax all -1 (a shared read-only row), no origin.
        self._unwatched = self.watcher.finish_step({}, n_modules)
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
        self._setup_tensors()
        self._active = True
        resume.begin(self)  # the first step's schedule, profiler window and opening snapshot

    def _setup_tensors(self) -> None:
        """Snapshots, sampled tensors (tensors.py) and the black box (blackbox.py)."""
        cfg = self.config
        if cfg.snapshot_every:
            self.snapshots = Snapshots(self.model, cfg.snapshot_every, cfg.snapshot_budget_bytes, cfg.snapshot_dtype)
        if cfg.sample_every:
            names = self.watcher.names
            if cfg.sample_modules is not None:
                chosen = [names.index(m) for m in cfg.sample_modules]
            else:  # the first, middle and last leaf modules computing with their own weights
                weighted = [i for i in range(len(names)) if self.watcher.is_leaf[i] and self.watcher.has_weights[i]]
                chosen = sorted({weighted[0], weighted[len(weighted) // 2], weighted[-1]}) if weighted else []
            self.samples = Samples(cfg.sample_every, cfg.sample_rows, cfg.sample_max_elements,
                                   cfg.sample_budget_bytes, self._fail)
            self.watcher.samples = self.samples
            self.watcher.sample_modules = {i: names[i] for i in chosen}
        if cfg.blackbox:
            self.blackbox = BlackBox(self.model, self._fail)
            self._opt_hook = optimizer_hooks.on_pre_step(self._pre_optimizer_step)

    def _snapshot(self, step: int) -> None:
        task = self.snapshots.take(step)
        self._last_snapshot = step
        if task is not None:
            # Never stalls training: a writer so far behind that its queue is full drops it.
            # (At creation and at close the queue is empty or drained anyway.)
            self.writer.put_task(task)

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

    def before_optimizer_step(self, optimizer) -> None:
        """Call after the step's backward, before ``optimizer.step()`` updates the parameters,
        where the global optimizer hook cannot: an optimizer stepped with a closure (Lightning's
        callback calls it; a loop of its own calls it at the end of its closure). Computes the
        gradient norms rec.step() records (once, here, reused there) and, if one is NaN/Inf,
        fires the black box while the parameters are still those the bad step started from.
        Optimizers of other models are ignored, and so are gradients judged already this step
        (the global hook after a call here)."""
        if not self._active or self.blackbox is None or not self.blackbox.armed:
            return None
        try:
            bad = self.norms.judge(optimizer, self._step)
            if bad:  # NaN/Inf gradients, not yet applied: the black box now
                names = [self._param_names[i] for i in bad]
                extra = {"n_params_affected": len(names), **self._replay()}
                self._fire(self.blackbox.capture(self._step, "grad_nonfinite", "start_of_step", optimizer, names,
                                                 self._param_name_by_id, extra))
        except Exception as e:
            self._fail(e)
        return None

    def _replay(self) -> dict:
        """On a step that was not watched, find where its NaN/Inf was born by running its forward
        passes again on a copy of the model (before the black box is written: it says how it went)."""
        return {} if self._watched else self.origin.replay(self.blackbox)

    def _fire(self, task) -> None:
        """Write the black box now, and wait for it to be on disk: the job may die next."""
        self.writer.put_task(task, timeout=30.0)
        self.writer.flush(timeout=120.0)

    def _set_schedule(self, step: int) -> None:
        """Tell the hooks what the coming step records, and hook every module if it records
        anything per module (a watched step; other steps hook only the root, see hooks.py)."""
        w = self.watcher
        w.sample_activations = self.attention.sampled = step >= self.planner.next_watch
        w.sample_histograms = bool(self.config.histogram_every) and step == self.planner.next_hist
        w.sample_tensors = self.samples is not None and self.samples.due(step)
        self._watched = w.sample_activations or w.sample_histograms or w.sample_tensors
        if self._watched or w.watching:  # (from one plain step to the next nothing changes)
            w.watch(self._watched)
            functional.watching(self, self._watched)
            if self.blackbox is not None:  # watched steps read the RNG states and check them
                self.blackbox.take_rng = self._watched or not self.blackbox.rng_free
        self.origin.new_step()
        self.activity.step = self.attention.step = step

    # -- observer of wrapped functions (functional.py) ---------------------------------------
    def on_activation(self, fn, args, kwargs, out) -> None:
        if self._active:
            self.activity.on_activation(fn, args, kwargs, out)

    def on_attention(self, fn, args, kwargs, out) -> None:
        if self._active:
            self.attention.on_attention(fn, args, kwargs, out)

    def on_data_wait(self, seconds: float) -> None:
        if self._active:
            self._data_wait_s += seconds
            self._saw_loader = True

    def on_observer_error(self, e: BaseException) -> None:
        self._fail(e)

    # -- per step -----------------------------------------------------------------------------
    def step(self, loss=None) -> None:
        """Mark the end of one training iteration (call it after ``optimizer.step()``)."""
        if self._active:
            if self._watched:  # (counted once the step has run: the activity window holds it)
                self.activity.steps_watched += 1
            try:
                t_called = time.perf_counter()
                self._sched = self.schedule.end_step(self._step)
                if not self._plain_step(loss, t_called):
                    self._record_step(loss, t_called)
            except Exception as e:
                self._fail(e)
            self.norms.entries = []
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

    def _plain_step(self, loss, t_called: float) -> bool:
        """Record a plain step, most of them: not watched, no sampled update ratio, activity
        window, profiler window or snapshot, its gradient norms already on the host (the
        optimizer step pre-hook), loss and norms finite. Right after a training step every line
        of Python runs cold (a numpy call there costs ~50 us, measured), so this does as little
        as it can: the loss's one transfer, a row of host values; the writer thread makes
        float32 of them, in bulk. Returns False, having recorded nothing, for any other step."""
        step = self._step
        next_update = self.planner.next_update
        if (self._watched or self.profiler.prof is not None or step == next_update
                or step + 1 == next_update or step >= self.activity.last_step):  # (window_ends)
            return False
        norms = self.norms.cached()
        if norms is None:
            return False
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                return False
            loss_value = loss.item()
        else:
            loss_value = float("nan") if loss is None else float(loss)
        if loss is not None and not math.isfinite(loss_value):
            return False  # a bad step is measured in full
        self._loss_given = loss is not None
        mods = self._unwatched  # (no module hooked: nothing to finish)
        ps = self.param_stats
        self._write_step(step, t_called, loss_value, mods, {
            "params": {"grad_norm": norms, "grad_absmax": ps.unmeasured, "grad_nonfinite": ps.no_bad_grads,
                       "param_norm": ps.unmeasured},
            "modules": {"output_absmax": mods["output_absmax"]}})
        self._end_step(step)
        return True

    def _record_step(self, loss, t_called: float) -> None:
        step = self._step
        watched = self._watched
        if watched and self.blackbox is not None:
            self.blackbox.check_rng()
        ps = self.param_stats
        pk = Packer()
        with torch.no_grad():  # (gradients are leaves: reducing them records no graph)
            ps.pack(pk, step, watched, self.watcher.sample_histograms)
            self.watcher.pack(pk)
            window_ends = self.activity.window_ends(step)
            if window_ends:
                self.activity.pack(pk)
            self.attention.pack(pk)
            if isinstance(loss, torch.Tensor):  # in the step's one transfer, or alone
                if pk.empty:
                    loss_value = float(loss.detach().reshape(-1)[0]) if loss.numel() else float("nan")
                else:
                    pk.add("loss", loss.detach().reshape(-1)[:1])
            host = pk.fetch()
            grads_bad = ps.grads_nonfinite(host)
            if not isinstance(loss, torch.Tensor) or "loss" in host:
                loss_value = self._loss_value(loss, host)
            # A step whose loss or gradients went NaN/Inf is measured in full, watched or not (a
            # second transfer, on that step only).
            bad_step = loss_is_bad(loss, loss_value) or grads_bad
            if bad_step and not watched:
                ps.measure_bad(host)
            param_row, grad_bad = ps.finish(host, step, watched or bad_step)

        hist_act = self.watcher.hist_rows(host, N_BINS) if self.watcher.sample_histograms else None
        mods = self.watcher.finish_step(host, len(self.watcher.names))
        self._loss_given = loss is not None
        if not watched and bad_step and self._trigger(loss_value, grad_bad, mods) is not None:
            self._replay()  # a NaN/Inf no optimizer step saw first: find its module now
        mods = self.origin.merge(mods, loss_is_bad(loss, loss_value))
        if self._params:
            self._device = self._params[0].device
        rows = {"params": param_row, "modules": {"output_absmax": mods["output_absmax"]}}
        if bad_step or mods["origin"] >= 0:  # what the loss function did (loss_graph.py)
            checks = self.origin.loss_check(step, loss, self.watcher.out_refs)
            if checks:
                rows["loss_checks"] = checks
        if "acts" in mods:
            rows["activations"] = {"step": step, **mods["acts"]}
        rows.update(ps.extra_rows(host, step, hist_act))  # update ratios, histograms
        if window_ends:
            rows["activity"] = self.activity.finish_window(step, host)
        attn = self.attention.finish_step(step, host)
        if attn is not None:
            rows["attention"] = attn
        # Sites first seen this step go in the same queue item as the rows that refer to them.
        rows["activity_sites"] = self.activity.take_new_sites()
        rows["attention_sites"] = self.attention.take_new_sites()
        rows["module_outputs"] = self.watcher.take_new_shapes()
        self._write_step(step, t_called, loss_value, mods, rows)
        task = self.profiler.end(step)
        if task is not None:
            self.writer.put_task(task)
        self._after_step(step, loss_value, grad_bad, mods,
                         bad_step or mods["origin"] >= 0 or bool(mods["batch_nonfinite"]))

    def _after_step(self, step: int, loss_value: float, grad_bad, mods, bad: bool) -> None:
        """Sampled tensors, the next snapshot, and the black box if this step broke without an
        optimizer step seeing it (NaN loss or output with finite gradients, a manual update)."""
        if self.samples is not None:
            task = self.samples.take(step)
            if task is not None:
                self.writer.put_task(task)
        bb = self.blackbox
        trigger = self._trigger(loss_value, grad_bad, mods) if bad else None
        if trigger is not None:
            self._fire(bb.capture(step, trigger, "end_of_step", extra={
                "note": "seen at rec.step(), after this step's update: no optimizer step saw NaN/Inf "
                        "gradients first (a NaN loss or output with finite gradients, or a hand-written update)",
                **({"origin_replay": self.origin.replayed["replay"]} if self.origin.replayed else {})}))
        self._end_step(step)

    def _write_step(self, step: int, t_called: float, loss_value: float, mods: dict, rows: dict) -> None:
        """Add the step's row of steps/ (loss, memory now, where NaN/Inf was born, the census,
        GC time, the time split) to its rows and queue them, then a CUDA snapshot if one is due.
        One dict, built once: right after a training step each call and dict update runs cold."""
        mem = self.memory
        alloc, reserved, peak, rss, n, nbytes, graphs, groups, gc_s, gc_gen2 = mem.read(step, self._device, t_called)
        time_s = time.time()
        self.planner.saw(step, loss_value, self._sched[0])
        if groups:
            rows["census_groups"] = [{"step": step, **g} for g in groups]
        snapshot_task = mem.cuda_snapshot(step) if mem.cuda is not None else None
        # Where the step's time went; NaN where a phase was not seen (no forward, first step,
        # no DataLoader).
        w = self.watcher
        t_fwd, t_fwd_end = w.t_forward_start, w.t_forward_end
        w.t_forward_start = w.t_forward_end = None
        w.out_refs = []
        prev, now = self._t_step_end, time.perf_counter()
        self._t_step_end = now
        rows["steps"] = {
            "step": step, "time_s": time_s, "loss": loss_value, "loss_given": int(self._loss_given), "rss_bytes": rss,
            "cuda_allocated_bytes": alloc, "cuda_reserved_bytes": reserved, "cuda_peak_bytes": peak,
            "nonfinite_origin": mods["origin"], "batch_nonfinite": mods["batch_nonfinite"],
            "nonfinite_consumer": mods.get("consumer", -1),
            "output_grad_nonfinite": mods.get("output_grad_nonfinite", -1),
            "live_tensors": n, "live_tensor_bytes": nbytes, "live_tensors_with_graph": graphs,
            "gc_s": gc_s, "gc_gen2": gc_gen2,
            "data_wait_s": self._data_wait_s if self._saw_loader else math.nan,
            "between_steps_s": t_fwd - prev if (t_fwd is not None and prev is not None) else math.nan,
            "forward_s": t_fwd_end - t_fwd if (t_fwd is not None and t_fwd_end is not None) else math.nan,
            "backward_s": t_called - t_fwd_end if t_fwd_end is not None else math.nan,
            "recorder_s": now - t_called,
            "lr": self._sched[0], "loss_scale": self._sched[1], "optimizer_steps": self._sched[2],
        }
        if self._sched[3] is not None:
            rows.update(self._sched[3])
        self._data_wait_s = 0.0
        self.writer.put(rows)
        if snapshot_task is not None:
            self.writer.put_task(snapshot_task)

    def _end_step(self, step: int) -> None:
        """The black box forgets the step; the parameters are snapshotted if the next step is due."""
        if self.blackbox is not None:
            self.blackbox.new_step()
        if self.snapshots is not None and self.snapshots.due(step + 1):
            self._snapshot(step + 1)

    def _trigger(self, loss_value: float, grad_bad, mods) -> str | None:
        """Why the black box fires at rec.step() on this step, or None."""
        if self.blackbox is None or not self.blackbox.armed:
            return None
        return ("loss_nonfinite" if self._loss_given and not np.isfinite(loss_value) else
                # Once an optimizer step of this model was seen, its pre-hook judges the
                # gradients: NaN/Inf gradients it never saw were not applied (AMP's
                # GradScaler skips such steps), and are no reason to fire.
                "grad_nonfinite" if (grad_bad > 0).any() and not self.norms.saw_optimizer
                and not self.schedule.scaler_skipped() else
                "activation_nonfinite" if mods["origin"] >= 0 else
                "input_nonfinite" if mods["batch_nonfinite"] else None)

    @staticmethod
    def _loss_value(loss, host: dict) -> float:
        if isinstance(loss, torch.Tensor):
            return float(host["loss"][0]) if host["loss"].size else float("nan")
        return float("nan") if loss is None else float(loss)

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
        self.schedule.remove()
        if getattr(self, "_opt_hook", None) is not None:
            self._opt_hook.remove()
            self._opt_hook = None
        if getattr(self, "blackbox", None) is not None:
            self.blackbox.remove()
        if getattr(self, "profiler", None) is not None:
            self.profiler.abort()
        functional.detach(self)
        if getattr(self, "memory", None) is not None:
            self.memory.detach()
        if self.attention is not None:
            self.attention.remove()
        if self.watcher is not None:
            self.watcher.remove()

    def _final_window(self) -> None:
        """Write the activity of the last, partial window (a short run gets one too)."""
        if self.activity is None or self._step == 0 or not self.activity.has_open_window(self._step - 1):
            return
        pk = Packer()
        with torch.no_grad():
            self.activity.pack(pk)
            host = pk.fetch()
        self.writer.put({"activity": self.activity.finish_window(self._step - 1, host),
                         "activity_sites": self.activity.take_new_sites()})

    def _final_tensors(self, reason: str) -> None:
        """At close: the black box if the job is leaving by an exception or SIGTERM (and it has
        not fired), and the final parameters as a snapshot."""
        try:
            bb = self.blackbox
            if bb is not None and bb.armed and (reason.startswith("exception") or reason == "sigterm"):
                self._fire(bb.capture(self._step, reason.split(":")[0], "at_exit", extra={"reason": reason}))
            if self.snapshots is not None and self._last_snapshot != self._step and self._step > 0:
                self._snapshot(self._step)
        except Exception as e:
            warnings.warn(f"torchautopsy: the final snapshot or black box could not be taken ({e!r})",
                          RuntimeWarning, stacklevel=3)

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
                self._final_window()
                self._final_tensors(reason)
            self._unhook()
            if was_active and self.writer is not None:
                self.writer.close({
                    "closed": True, "end_reason": reason, "end_unix": time.time(),
                    "n_steps_recorded": self._step,
                    **({"snapshot_note": self.snapshots.skipped} if self.snapshots and self.snapshots.skipped else {}),
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
            self.memory.on_oom_exception(self._step, self._device, exc, tb)
