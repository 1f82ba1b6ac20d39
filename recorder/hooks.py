"""Forward hooks on every module, on watched steps: the finite check and activation statistics.

Every module is hooked only on the steps the recorder watches (every ``activations_every``-th,
and the histogram, sample and attention steps): a hooked module costs ~10 us of Python per call
and a reduction over its output, too much for every step of a small model. On the other steps
only the root module is hooked (for the step's timing). A NaN/Inf born on an unwatched step is
still seen on its step, in the loss and gradient norms, and its module is then found by running
the step again on a copy of the model with every module hooked (replay.py), with this same class.

The finite check of a tensor is its max and max |x|: NaN if any element is NaN, infinite if any
is. A module *produced* a NaN/Inf (rather than passing one on) when its output is non-finite
while its inputs were not; inputs that are the output of a module already seen this step reuse
that module's result, so in the common case (a chain of modules) inputs cost nothing. How the
checks and statistics are reduced, per tensor at once (CPU) or a few foreach ops for all modules
at the end of the forward (GPU), is watch_batch.py's Measurements.

Under ``torch.compile`` the hooks of the modules inside the compiled forward return at once
while Dynamo traces them (``compiling()`` is a constant there, see functional.py): the compiled
forward runs the graph it would run without the recorder, so its inner modules are not measured
(-1, as on unwatched steps). The root's hooks run eagerly (functional.eager), outside the graph:
the batch's statistics, the forward's time, the root's own finite check (a NaN the compiled
forward made is seen leaving it) and the black box's inputs are as without compile. Dynamo
still guards on how many hooks an inner module has, and would compile the model again when
hooks come or go; so once a module's hook has been traced, the per-module hooks stay as they are
(watch) and the model is compiled once, as without the recorder (counted in
tests/recorder/test_compile.py). A submodule compiled on its own is noticed the same way.
"""

from __future__ import annotations

import math
import time
import weakref

import numpy as np
import torch
from torch import nn

from .call_sites import CallSites
from .functional import compiling, eager
from .histograms import histogram
from .input_stats import InputStats
from .loss_graph import mark_outputs
from .profiler import own_work
from .stats import Packer, combine_stats, floating_tensors
from .watch_batch import Measurements


_BATCH = -2  # (finish_step: the -Inf came with the input batch)
MAX_SITE_CALLS = 16  # activation or attention sites of one module (next_call)


class ModuleWatcher:
    def __init__(self, model: nn.Module, on_error):
        self.names = [name for name, _ in model.named_modules()]
        self.types = [type(m).__name__ for _, m in model.named_modules()]
        self.is_leaf = [len(list(m.children())) == 0 for _, m in model.named_modules()]
        # Modules computing with their own weights (Linear, Conv, ...).
        self.has_weights = np.array([any(True for _ in m.parameters(recurse=False))
                                     for _, m in model.named_modules()], dtype=bool)
        self.modules = [m for _, m in model.named_modules()]
        self._on_error = on_error
        # Which module's forward is running, innermost last, with per-forward call counters:
        # a function called inside a forward (F.relu, F.scaled_dot_product_attention) is
        # attributed to the innermost module, and told apart by its call number.
        # [module index, activation calls, attention calls, input check indices or None]
        self.stack: list[list] = []
        self._handles = []  # the per-module hooks, while watching
        self.watching = False
        # The root's forward ran as torch.compile'd code (set by _timing_pre_hook): hooks seen
        # by Dynamo no longer come and go (watch).
        self.compiled = False
        # Also check forward passes under no_grad (the replay of a step runs under no_grad).
        self.check_no_grad = False
        # The step's timing needs only the root module, hooked on every step.
        self.inputs = InputStats()  # the batch's statistics, every training forward (input_stats.py)
        self._timing_handles = [self.modules[0].register_forward_pre_hook(eager(self._timing_pre_hook), with_kwargs=True),
                                self.modules[0].register_forward_hook(eager(self._timing_hook))]
        self.sample_activations = False
        # Histograms of these modules' outputs (module index -> row) on histogram steps, and
        # whole outputs of a few modules (module index -> name) handed to `samples` on sample steps.
        self.hist_modules: dict[int, int] = {}
        self.sample_histograms = False
        self.sample_modules: dict[int, str] = {}
        self.samples = None
        self.sample_tensors = False
        self._hist_keys: list[int] = []
        self._shape_seen = [False] * len(self.names)
        self._new_shapes: list[dict] = []
        self.t_forward_start: float | None = None
        self.t_forward_end: float | None = None
        # The model's mode at its forward passes since the last rec.step(): bit 1 a pass with
        # gradients in train mode, bit 2 one in eval mode; and passes without gradients in train
        # mode (an evaluation that forgot model.eval()). Read by step_rows.py, then reset.
        self.mode_bits = 0
        self.nograd_train_forwards = 0
        self.out_refs: list = []  # weak references to the step's last training forward's outputs
        # Forward passes with no rec.step() after them (a long evaluation loop) must not grow
        # memory without bound: past this many calls in one step, calls go unchecked.
        self.max_calls = 64 * len(self.names) + 1024
        self._unmeasured = np.zeros(0, dtype=np.float32)  # the row of a step not watched: -1s
        self.meas = Measurements()  # fused_option: set by the Recorder (fused_reductions)
        # Fused steps (watch_batch.py): modules seen writing into their inputs (and those that
        # say inplace=True), measured before they run; modules whose outputs are written in place
        # after they return, measured as they return.
        self.call_sites = CallSites(MAX_SITE_CALLS)  # the calls of a module called more than once
        self.writes_input = {i for i, m in enumerate(self.modules) if getattr(m, "inplace", False) is True}
        self.written_after: set[int] = set()
        self._reset()

    @staticmethod
    def next_call(frame: list, slot: int) -> int:
        """The number of this activation (slot 1) or attention (slot 2) call within the frame's
        module during the step, counted over its calls (a module called twice has sites of its
        own per call); calls past MAX_SITE_CALLS share the last site (a cell looped over time)."""
        frame[slot] += 1
        return min(frame[slot] - 1, MAX_SITE_CALLS - 1)

    def current(self) -> list | None:
        """The frame of the innermost module whose forward is running, or None (also while
        gradients are disabled: forward passes under no_grad are evaluation, not recorded)."""
        if not self.stack or not (self.check_no_grad or torch.is_grad_enabled()):
            return None
        return self.stack[-1]

    def watch(self, on: bool) -> None:
        """Hook every module (a watched step), or only the root's timing (other steps)."""
        # Once the model's forward has run compiled, the hooks stay as they were when it was
        # compiled: Dynamo guards on their number, and adding or removing them would compile it
        # again (see the module's docstring). Those left in place check `watching`.
        if not self.compiled:
            self._hook_modules(on)
        self.watching = on

    def _hook_modules(self, on: bool) -> None:
        if on and not self._handles:
            for i, m in enumerate(self.modules):
                # First of the module's pre-hooks (registered long after the others): they see
                # this module as the one running (the attention capture's, for one).
                pre, post = self._make_pre_hook(i), self._make_hook(i)
                if i == 0:  # the root's run eagerly under torch.compile (functional.eager)
                    pre, post = eager(pre), eager(post)
                self._handles.append(m.register_forward_pre_hook(pre, prepend=True))
                self._handles.append(m.register_forward_hook(post))
        elif not on and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []

    def _timing_pre_hook(self, module, args, kwargs):
        if self.t_forward_start is None:
            self.t_forward_start = time.perf_counter()
        if torch.is_grad_enabled():  # a training forward: its batch's statistics
            try:
                with own_work():
                    self.inputs.on_forward(args, kwargs)
            except Exception as e:  # never into the training's forward
                self._on_error(e)
        return None

    def _timing_hook(self, module, args, output):
        self.t_forward_end = time.perf_counter()
        grad = torch.is_grad_enabled()
        if grad:
            self.mode_bits |= 1 if module.training else 2
        elif module.training:
            self.nograd_train_forwards += 1
        if grad:  # a training forward: its outputs, for a loss gone NaN (loss_graph.py)
            try:
                with own_work():
                    self.out_refs = mark_outputs(output)
            except Exception as e:  # never into the training's forward
                self.out_refs = []
                self._on_error(e)

    def producer(self, x) -> int:
        """Index of the module whose forward returned tensor x this step, or -1."""
        hit = self._producers.get(id(x))
        return hit[1] if hit is not None and hit[0]() is x else -1

    def take_new_shapes(self) -> list[dict]:
        new, self._new_shapes = self._new_shapes, []
        return new

    def _reset(self) -> None:
        self.stack = []
        self._producers: dict[int, tuple[weakref.ref, int]] = {}
        self.meas.reset()  # the checks and statistics of the step (watch_batch.py)
        self._calls: list[tuple[int, list[int], list[int]]] = []  # (module, input checks, output checks)
        self._site_calls: dict[int, tuple[int, int]] = {}  # module -> its activation, attention calls this step
        self._acts: dict[int, list[int]] = {}  # module -> statistics rows, one per call
        self._hists: dict[int, torch.Tensor] = {}  # module -> summed histogram counts
        self._sampled: set[int] = set()  # modules whose output was sampled this step
        # Whether the gradient that reached the model's outputs in the backward pass held NaN/Inf
        # (one 0-d device tensor per output, on watched steps): a NaN born in the loss's backward.
        self._out_grads: list[torch.Tensor] = []

    def _flush(self) -> None:
        """Reduce what the step registered so far (fused), and learn from the outputs that were
        written in place after their module returned: flushed as it returns, from now on."""
        with torch.no_grad():
            self.written_after |= self.meas.flush()

    def remove(self) -> None:
        self._hook_modules(False)
        self.watching = False
        for h in self._timing_handles:
            h.remove()
        self._timing_handles = []
        self._reset()

    def _make_pre_hook(self, index: int):
        def pre_hook(module, args):
            if compiling():
                # Not run here but replayed by the compiled code after each call (Dynamo keeps a
                # traced attribute store as a side effect): the forward ran compiled.
                self.compiled = True
                return
            if not self.watching:
                return
            # Inputs are checked before the forward runs: a module that writes NaN into its
            # input in place (x.mul_(nan)) must be seen receiving finite inputs.
            ins = None
            # (no torch.no_grad() needed here or in hook(): every reduction runs on a detached
            # tensor, so none records a graph, and the context manager costs ~2 us a call)
            versions = None
            if (self.check_no_grad or torch.is_grad_enabled()) and len(self._calls) < self.max_calls:
                try:
                    with own_work():
                        inputs = floating_tensors(args)
                        ins = [self.meas.check(x) for x in inputs]
                        if self.meas.fused:  # (a module that writes into its input: measured before it does)
                            versions = [x._version for x in inputs]
                            if index in self.writes_input:
                                self._flush()
                except Exception as e:  # never raise into the model's forward
                    self._on_error(e)
            # The activation and attention calls counted on from this module's earlier calls in
            # the step: each call of a module called twice (BasicBlock's one nn.ReLU) is a site.
            acts, attns = self._site_calls.get(index, (0, 0))
            self.stack.append([index, acts, attns, ins, versions])

        return pre_hook

    def _make_hook(self, index: int):
        def hook(module, args, output):
            if compiling() or not self.watching:
                return
            # Pop this module's frame (and any left by a forward that raised inside it).
            frame = None
            while self.stack:
                frame = self.stack.pop()
                if frame[0] == index:
                    break
            ins = frame[3] if frame is not None and frame[0] == index else None
            if frame is not None and frame[0] == index:
                self._site_calls[index] = (frame[1], frame[2])
            if ins is None:  # evaluation under no_grad (not recorded), or too many calls
                return
            try:
                with own_work():
                    self._on_output(index, ins, output)
                    if self.meas.fused:
                        if frame[4] and any(x._version != v for x, v in zip(floating_tensors(args), frame[4])):
                            self.writes_input.add(index)  # measure its inputs before it runs, from now on
                        if index == 0 or index in self.written_after:
                            self._flush()
            except Exception as e:  # never raise into the model's forward
                self._on_error(e)

        return hook

    def _on_output(self, index: int, ins: list[int], output) -> None:
        """A watched call's outputs: checked, their statistics and histograms, samples."""
        outs = floating_tensors(output)
        if not outs:
            return
        self._calls.append((index, ins, [self.meas.check(x, index) for x in outs]))
        if index == 0 and torch.is_grad_enabled():
            for x in outs[:4]:
                if x.requires_grad:
                    x.register_hook(self._on_output_grad)  # (observes; returns None)
        if not self._shape_seen[index]:
            self._shape_seen[index] = True
            # Its first 4 outputs' shapes, dtypes and the op that made each (e.g.
            # ReluBackward0): tensors the census finds kept are matched to their maker.
            self._new_shapes.extend({
                "module": index, "shape": "[" + ", ".join(map(str, x.shape)) + "]",
                "dtype": str(x.dtype).replace("torch.", ""),
                "grad_fn": type(x.grad_fn).__name__ if x.grad_fn is not None else ""} for x in outs[:4])
        if outs[0].dim() == 3:  # channels-first or sequence: the producer tells
            self._producers[id(outs[0])] = (weakref.ref(outs[0]), index)
        if self.sample_activations:
            self._acts.setdefault(index, []).append(self.meas.stats_row(outs[0]))
        if self.sample_histograms and index in self.hist_modules:
            h = histogram(outs[0])
            prev = self._hists.get(index)
            self._hists[index] = h if prev is None else prev + h.to(prev.device)
        if self.sample_tensors and index in self.sample_modules and index not in self._sampled:
            self._sampled.add(index)  # the first call of the step
            self.samples.on_output(self.sample_modules[index], outs[0])

    def _on_output_grad(self, grad: torch.Tensor | None) -> None:
        if grad is None:  # an output the loss did not use (a compiled graph's backward gives None)
            return
        try:
            with own_work():
                self._out_grads.append((~torch.isfinite(grad.detach())).any().to(torch.float32))
        except Exception as e:  # never raise into the backward pass
            self._on_error(e)

    def pack(self, packer: Packer) -> None:
        if self.meas.empty:  # nothing checked: a step that was not watched
            return
        with torch.no_grad():
            self.written_after |= self.meas.pack(packer)
        if self._out_grads:
            dev = self._out_grads[0].device
            packer.add("out_grad_bad", [t.to(dev) for t in self._out_grads])
        self._hist_keys = list(self._hists.keys())
        if self._hists:
            dev = next(iter(self._hists.values())).device
            packer.add("hist_act", [h.to(dev) for h in self._hists.values()])

    def hist_rows(self, host: dict[str, np.ndarray], n_bins: int) -> np.ndarray:
        """(histogrammed modules x bins) counts of this step; -1 for modules not called."""
        out = np.full((len(self.hist_modules), n_bins), -1, dtype=np.int64)
        if self._hist_keys:
            counts = host["hist_act"].reshape(len(self._hist_keys), n_bins)
            for k, index in enumerate(self._hist_keys):
                out[self.hist_modules[index]] = counts[k]
        return out

    def _inside(self, inner: int, outer: int) -> bool:
        """Module `inner` is a submodule of `outer` (by name: its forward runs inside outer's)."""
        return inner != outer and (outer == 0 or self.names[inner].startswith(self.names[outer] + "."))

    def finish_step(self, host: dict[str, np.ndarray], n_modules: int, step: int = -1) -> dict:
        """Turn step ``step``'s host values into per-module rows (and per-call ones for a module
        called more than once: call_sites.py); then forget the step."""
        if not self._calls and not self._acts:  # not watched: nothing measured (-1)
            if len(self._unmeasured) != n_modules:
                self._unmeasured = np.full(n_modules, -1.0, dtype=np.float32)
                self._unmeasured.flags.writeable = False
            if not self.meas.empty or self._producers or self._hists or self.stack:
                self._reset()
            return {"output_absmax": self._unmeasured, "origin": -1, "consumer": -1, "neg_origin": -1,
                    "batch_nonfinite": 0, "output_grad_nonfinite": -1}
        maxs, absmax, acts = self.meas.host_values(host)
        # A NaN or +Inf is a fault. A -Inf alone is how masks and log-probabilities of impossible
        # events are written: whether it is one is decided by where it goes, not by who made it.
        # Into a softmax or a masked fill it is a mask (their outputs stay finite); it is a fault
        # when a module that takes it makes NaN/+Inf of it (a Linear: -inf * w + inf), or when
        # the step's loss went non-finite (a sum, a loss outside the modules: neg_origin). Either way the
        # origin is the module that made the -Inf from finite inputs, and `consumer` the module
        # that turned it into NaN/+Inf (-1: none, or the origin made NaN/+Inf itself).
        bad = np.isnan(absmax) | (maxs == np.inf)
        neg_inf = (absmax == np.inf) & ~bad  # max |x| infinite, max not: a -Inf
        if any(self.meas.stale):  # written in place before measured: not known (-1)
            stale = np.array(self.meas.stale, dtype=bool)
            bad, neg_inf, absmax = bad & ~stale, neg_inf & ~stale, np.where(stale, -1.0, absmax)
        out_absmax = [-1.0] * n_modules  # -1: not called this step
        origin, consumer, first_bad, batch_bad = -1, -1, -1, False
        first_neg = last_neg = -1  # the first and the latest module that made a -Inf from finite inputs
        # Plain Python over the calls: a few values each, where numpy's per-call cost dominates.
        amax, bad_l, neg_l = absmax.tolist(), bad.tolist(), neg_inf.tolist()
        faults = bool(bad.any() or neg_inf.any())
        made_neg: dict[int, int] = {}  # tensor (pair index) holding -Inf -> the module that made it
        neg_makers: list[int] = []  # the modules that made a -Inf from finite inputs, in order
        if faults:  # (the root's call completes last: its inputs, the batch, are seen first here)
            for module, ins, _ in self._calls:
                if module == 0:
                    made_neg.update((i, _BATCH) for i in ins if neg_l[i])
        for module, ins, outs in self._calls:
            vals = [amax[o] for o in outs]
            a = math.nan if any(v != v for v in vals) else max(vals)  # v != v: NaN
            prev = out_absmax[module]
            out_absmax[module] = a if prev < 0 else (math.nan if prev != prev or a != a else max(a, prev))
            if not faults:
                continue
            in_bad = any(bad_l[i] for i in ins)
            in_neg = [i for i in ins if neg_l[i]]
            if module == 0 and in_bad:
                batch_bad = True
            if any(bad_l[o] for o in outs):
                if first_bad < 0:
                    first_bad = module
                if origin < 0 and not in_bad:
                    if not in_neg:
                        origin = module  # born here, from finite inputs ...
                        inner = [m for m in neg_makers if self._inside(m, module)]
                        if inner:  # ... unless a -Inf a submodule made went into it (cat, arithmetic)
                            origin, consumer = inner[-1], module
                    else:  # a -Inf made a fault here: the module that made it is the origin
                        # (that tensor's maker; else, after ops outside the modules, the last
                        # module that made a -Inf from finite inputs)
                        origin, consumer = made_neg.get(in_neg[0], last_neg if last_neg >= 0 else module), module
            elif not in_bad and not in_neg and any(neg_l[o] for o in outs):
                for o in outs:
                    if neg_l[o]:
                        made_neg.setdefault(o, module)
                if first_neg < 0:
                    first_neg = module
                last_neg = module
                neg_makers.append(module)
        # Should the step's loss be NaN/Inf with no module output NaN/+Inf, a -Inf went into it
        # outside the modules (a sum, the loss function): its maker, or the batch, is the origin
        # (the recorder decides at rec.step(), where the loss is known: neg_origin).
        neg_origin = -1
        if first_bad < 0:
            neg_origin = first_neg if first_neg >= 0 else (_BATCH if _BATCH in made_neg.values() else -1)
        if origin == _BATCH:  # a -Inf of the input batch made the fault
            origin, batch_bad = -1, True
        out_absmax = np.array(out_absmax)
        # (per-call statistics only where no call's rows were dropped as stale: their order holds)
        per_call = self.call_sites.finish(step, self._calls, amax,
                                          self._acts if self._acts and not any(self.meas.stale_parts) else None,
                                          np.array(self.meas.numel), acts)
        row = {
            "output_absmax": out_absmax.astype(np.float32),
            "origin": origin if origin >= 0 else first_bad,
            "consumer": consumer,
            "neg_origin": neg_origin,
            # 1: the gradient reaching the model's outputs held NaN/Inf; 0: finite; -1: no backward seen
            "output_grad_nonfinite": int(host["out_grad_bad"].any()) if "out_grad_bad" in host else -1,
            "batch_nonfinite": int(batch_bad),
        }
        if per_call is not None:
            row["call_outputs"] = per_call
        if self._acts:
            calls = self._acts
            if any(self.meas.stale_parts):  # written in place before measured: left out
                gone = self.meas.stale_parts
                calls = {m: kept for m, rows in calls.items() if (kept := [r for r in rows if not gone[r]])}
            mean, std, zero = combine_stats(n_modules, calls, np.array(self.meas.numel), acts)
            # NaN/Inf in the output: not counted (a pass more per output), only flagged: -2 for
            # "held some"; 0 for none; -1 for a module not called.
            called = out_absmax >= 0
            held = ~np.isfinite(out_absmax)
            row["acts"] = {
                "mean": mean.astype(np.float32),
                "std": std.astype(np.float32),
                "absmax": np.where(out_absmax < 0, np.nan, out_absmax).astype(np.float32),
                "zero_frac": zero.astype(np.float32),
                "nonfinite": np.where(held, -2, np.where(called, 0, -1)).astype(np.int32),
            }
        self._reset()
        return row
