"""One rec.step(): what the probes measured on the device goes to the host in one transfer and
becomes the step's rows (steps/ and the tables the probes fill), queued for the writer thread.
The Recorder (recorder.py) decides when; this is the work of each step: each probe (probe.py)
packs its reductions, the one transfer, then the rows. The gradient, module and batch rows make
the step's own rows (params/, modules/, steps/) and decide whether it went bad; the other probes'
rows are theirs alone."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import torch

from .blackbox.captures import trigger
from .blackbox.loss_graph import loss_ops
from .blackbox.nan_origin import loss_is_bad
from .distributed.local_grads import combine
from .forward.input_stats import INPUT_COLUMNS, InputStats
from .probe import StepPlan
from .reductions.histograms import N_BINS
from .reductions.stats import Packer


class StepRows:
    def __init__(self, *, watcher, param_stats, norms, activity, attention, origin, inputs, local_grads,
                 fingerprints, mode, memory, clock, planner, profiler, captures, schedule, writer, params: list,
                 device):
        self.watcher, self.param_stats, self.norms = watcher, param_stats, norms
        self.activity, self.attention, self.origin = activity, attention, origin
        self.inputs, self.local_grads, self.fingerprints = inputs, local_grads, fingerprints
        self.mode, self.memory, self.clock, self.planner, self.profiler = mode, memory, clock, planner, profiler
        self.captures, self.schedule, self.writer = captures, schedule, writer
        # What joins a recorded step's one transfer, in its order; and the probes with rows of their own.
        self._packing = (param_stats, watcher, activity, attention, fingerprints, local_grads, inputs)
        self._with_rows = (fingerprints, activity, attention, watcher)
        self._params = params
        self.device = device  # the model's, as of the last recorded step
        self.input_row = InputStats().combine(())  # (the row of a step without inputs)
        self.loss_given = False
        self.loss_function_seen = False  # (loss_function/ written)
        # A step without module hooks: output_absmax all -1 (a shared read-only row), no origin.
        self.unwatched = self.watcher.finish_step({}, len(self.watcher.names))

    def plain(self, plan: StepPlan, loss, t_called: float, sched: tuple) -> bool:
        """Record a plain step, most of them: not watched, no sampled update ratio, activity
        window, profiler window or snapshot, its gradient norms already on the host (the
        optimizer step pre-hook), loss and norms finite. Right after a training step every line
        of Python runs cold (a numpy call there costs ~50 us, measured), so this does as little
        as it can: the loss's one transfer, a row of host values; the writer thread makes
        float32 of them, in bulk. Returns False, having recorded nothing, for any other step."""
        step, next_update = plan.step, self.planner.next_update
        if (plan.watched or self.profiler.prof is not None or step == next_update or self.fingerprints.due(step)
                or step + 1 == next_update or step >= self.activity.last_step):  # (window_ends)
            return False
        norms = self.norms.cached()
        if norms is None:
            return False
        if isinstance(loss, torch.Tensor) and loss.numel() != 1:
            return False
        local, inputs = self.local_grads.take(), self.inputs.take()
        # One transfer: the loss, DDP's local bucket norms and the batch's statistics.
        loss_value, (local_v, inputs_v) = _to_host(loss, [torch.stack(local)] if local else [], inputs)
        if loss is not None and not math.isfinite(loss_value):
            self.local_grads.put_back(local)
            self.inputs.put_back(inputs)
            return False  # a bad step is measured in full
        self.loss_given = loss is not None
        mods = self.unwatched  # (no module hooked: nothing to finish)
        ps = self.param_stats
        self.input_row = self.inputs.combine(inputs_v)
        rows = {"params": {"grad_norm": norms, "grad_absmax": ps.unmeasured, "grad_nonfinite": ps.no_bad_grads,
                           "param_norm": ps.unmeasured},
                "modules": {"output_absmax": mods["output_absmax"]}}
        if not self.loss_function_seen:
            self._loss_function(step, loss, rows)
        self._write(step, t_called, loss_value, combine(local_v), mods, sched, rows)
        self.captures.end_step(step)
        return True

    def record(self, plan: StepPlan, loss, t_called: float, sched: tuple) -> None:
        """Record any other step: everything measured on the device goes to the host in one
        transfer, is made into the step's rows and queued; the black box fires if the step broke."""
        step, watched = plan.step, plan.watched
        if watched and self.captures.blackbox is not None:
            self.captures.blackbox.check_rng()
        ps = self.param_stats
        pk = Packer()
        with torch.no_grad():  # (gradients are leaves: reducing them records no graph)
            for probe in self._packing:
                probe.pack(pk, plan)
            if isinstance(loss, torch.Tensor):  # in the step's one transfer, or alone
                if pk.empty:
                    loss_value = float(loss.detach().reshape(-1)[0]) if loss.numel() else float("nan")
                else:
                    pk.add("loss", loss.detach().reshape(-1)[:1])
            host = pk.fetch()
            grads_bad = ps.grads_nonfinite(host)
            if not isinstance(loss, torch.Tensor) or "loss" in host:
                loss_value = _loss_value(loss, host)
            # A step whose loss or gradients went NaN/Inf is measured in full, watched or not (a
            # second transfer, on that step only).
            bad_step = loss_is_bad(loss, loss_value) or grads_bad
            if bad_step and not watched:
                ps.measure_bad(host)
            param_row, grad_bad = ps.finish(host, step, watched or bad_step)
            bad_hist = bad_step and not plan.histograms and ps.bad_step_histograms(host)

        hist_act = (self.watcher.hist_rows(host, N_BINS) if plan.histograms else
                    np.full((len(self.watcher.hist_modules), N_BINS), -1) if bad_hist else None)  # (-1: not taken)
        mods = self.watcher.finish_step(host, len(self.watcher.names), step)
        self.loss_given = loss is not None
        # (a compiled forward's inner modules are not measured even on a watched step: replayed too)
        if (not watched or self.watcher.compiled) and bad_step and self.trigger(loss_value, grad_bad, mods) is not None:
            self.origin.replay(self.captures.blackbox)  # a NaN/Inf no optimizer step saw first: find its module now
        mods = self.origin.merge(mods, loss_is_bad(loss, loss_value), grads_bad)
        if self._params:  # (model.to() keeps the Parameter objects)
            self.device = self._params[0].device
        rows = {"params": param_row, "modules": {"output_absmax": mods["output_absmax"]}}
        if bad_step or mods["origin"] >= 0:  # what the loss function did (blackbox/loss_graph.py)
            checks = self.origin.loss_check(step, loss)
            if checks:
                rows["loss_checks"] = checks
        if "acts" in mods:
            rows["activations"] = {"step": step, **mods["acts"]}
        if "call_outputs" in mods:
            rows["call_outputs"] = mods["call_outputs"]
        rows.update(ps.extra_rows(host, step, hist_act))  # update ratios, histograms
        # (sites first seen this step go in the same queue item as the rows that refer to them)
        for probe in self._with_rows:
            rows.update(probe.rows(plan, host))
        self.input_row = self.inputs.combine(host.get("inputs", ()))
        if not self.loss_function_seen:
            self._loss_function(step, loss, rows)
        self._write(step, t_called, loss_value, combine(host.get("local_grad", ())), mods, sched, rows)
        task = self.profiler.end(step)
        if task is not None:
            self.writer.put_task(task)
        bad = bad_step or mods["origin"] >= 0 or bool(mods["batch_nonfinite"])
        self.captures.after_step(step, self.trigger(loss_value, grad_bad, mods) if bad else None,
                                 self.origin.replayed["replay"] if self.origin.replayed else None)

    def _write(self, step: int, t_called: float, loss_value: float, local_grad: float, mods: dict, sched: tuple,
               rows: dict) -> None:
        """Add the step's row of steps/ (loss, memory now, where NaN/Inf was born, the census,
        GC time, the time split) to its rows and queue them, then a CUDA snapshot if one is due.
        One dict, built once: right after a training step each call and dict update runs cold."""
        mem = self.memory
        alloc, reserved, peak, rss, n, nbytes, graphs, groups, gc_s, gc_gen2 = mem.read(step, self.device, t_called)
        time_s = time.time()
        self.planner.saw(step, loss_value, sched[0])
        if groups:
            rows["census_groups"] = [{"step": step, **g} for g in groups]
        snapshot_task = mem.cuda_snapshot(step) if mem.cuda is not None else None
        wait, between, forward, backward, own = self.clock.split(t_called)
        mode, nograd_train = self.mode.take()
        rows["steps"] = {
            "step": step, "time_s": time_s, "loss": loss_value, "loss_given": int(self.loss_given), "rss_bytes": rss,
            "cuda_allocated_bytes": alloc, "cuda_reserved_bytes": reserved, "cuda_peak_bytes": peak,
            "nonfinite_origin": mods["origin"], "batch_nonfinite": mods["batch_nonfinite"],
            "nonfinite_consumer": mods.get("consumer", -1),
            "output_grad_nonfinite": mods.get("output_grad_nonfinite", -1),
            "live_tensors": n, "live_tensor_bytes": nbytes, "live_tensors_with_graph": graphs,
            "gc_s": gc_s, "gc_gen2": gc_gen2,
            "data_wait_s": wait, "between_steps_s": between, "forward_s": forward, "backward_s": backward,
            "recorder_s": own,
            "lr": sched[0], "loss_scale": sched[1], "optimizer_steps": sched[2], "local_grad_norm": local_grad,
            "grads_kept": self.norms.kept, "train_mode": mode, "nograd_train_forwards": nograd_train,
            **dict(zip(INPUT_COLUMNS, self.input_row)),
        }
        if sched[3] is not None:
            rows.update(sched[3])
        self.writer.put(rows)
        if snapshot_task is not None:
            self.writer.put_task(snapshot_task)

    def _loss_function(self, step: int, loss, rows: dict) -> None:
        """The loss function's ops, once (the analyzer's initial-loss check: a cross-entropy starts
        near ln(classes)); the outputs are marked on training forwards (blackbox/loss_graph.py)."""
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return
        ops = loss_ops(loss)
        if ops is not None:
            self.loss_function_seen = True
            rows["loss_function"] = {"step": step, "ops": json.dumps(ops)}

    def trigger(self, loss_value: float, grad_bad, mods) -> str | None:
        """Why the black box fires at rec.step() on this step, or None. Once an optimizer step of
        this model was seen, its pre-hook judges the gradients (captures.trigger)."""
        if not self.captures.armed:
            return None
        return trigger(self.loss_given, loss_value, grad_bad, mods,
                       lambda: self.norms.saw_optimizer or self.schedule.scaler_skipped())


def _to_host(loss, *groups: list[torch.Tensor]) -> tuple[float, list[list[float]]]:
    """(the loss as a float, each group's tensors flattened to floats) in one device->host copy
    (a copy per device where they are on several)."""
    parts = [t if t.dim() == 1 else t.reshape(-1) for g in groups for t in g]  # (1-D already: no view op)
    with torch.no_grad():  # (the loss joins a cat: no graph recorded, no detach op)
        if isinstance(loss, torch.Tensor):
            if not parts:  # most steps of most jobs: the loss alone
                return loss.item(), [[] for _ in groups]
            parts.append(loss.reshape(1))
        if not parts:
            values = []
        elif len(parts) == 1:
            values = parts[0].tolist()
        else:
            try:
                values = torch.cat(parts).tolist()  # (cat promotes to one dtype)
            except RuntimeError:  # several devices (model parallel)
                values = [v for p in parts for v in p.tolist()]
    if isinstance(loss, torch.Tensor):
        loss_value = float(values.pop())
    else:
        loss_value = float("nan") if loss is None else float(loss)
    out, i = [], 0
    for g in groups:
        n = sum(t.numel() for t in g)
        out.append(values[i:i + n])
        i += n
    return loss_value, out


def _loss_value(loss, host: dict) -> float:
    if isinstance(loss, torch.Tensor):
        return float(host["loss"][0]) if host["loss"].size else float("nan")
    return float("nan") if loss is None else float(loss)
