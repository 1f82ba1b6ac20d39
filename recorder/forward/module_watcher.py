"""Forward hooks on every module, on watched steps: the finite check and activation statistics.

Every module is hooked only on the steps the recorder watches (every ``activations_every``-th,
and the histogram, sample and attention steps): a hooked module costs ~10 us of Python per call
and a reduction over its output, too much for every step of a small model. On the other steps
only the root module is hooked (root_hooks.py: the step's timing, mode and batch). A NaN/Inf
born on an unwatched step is still seen on its step, in the loss and gradient norms, and its
module is then found by running the step again on a copy of the model with every module hooked
(blackbox/replay.py), with this same class.

The finite check of a tensor is its max and max |x|: NaN if any element is NaN, infinite if any
is. A module *produced* a NaN/Inf (rather than passing one on) when its output is non-finite
while its inputs were not; inputs that are the output of a module already seen this step reuse
that module's result, so in the common case (a chain of modules) inputs cost nothing. How the
checks and statistics are reduced, per tensor at once (CPU) or a few foreach ops for all modules
at the end of the forward (GPU), is reductions/fused.py's Measurements.

Under ``torch.compile`` the hooks of the modules inside the compiled forward return at once
while Dynamo traces them (``compiling()`` is a constant there, see wrapped_functions.py): the compiled
forward runs the graph it would run without the recorder, so its inner modules are not measured
(-1, as on unwatched steps). The root's hooks run eagerly (wrapped_functions.eager), outside the graph:
the batch's statistics, the forward's time, the root's own finite check (a NaN the compiled
forward made is seen leaving it) and the black box's inputs are as without compile. Dynamo
still guards on how many hooks an inner module has, and would compile the model again when
hooks come or go; so once a module's hook has been traced, the per-module hooks stay as they are
(watch) and the model is compiled once, as without the recorder (counted in
tests/recorder/test_compile.py). A submodule compiled on its own is noticed the same way.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import nn

from ..blackbox.nan_origin import born_where
from ..probe import Probe, StepPlan
from ..profiler.profile_windows import own_work
from ..reductions.fused import Measurements
from ..reductions.histograms import histogram
from ..reductions.stats import Packer, combine_stats, floating_tensors
from .call_sites import CallSites
from .wrapped_functions import compiling, eager


MAX_SITE_CALLS = 16  # activation or attention sites of one module (next_call)


class ModuleWatcher(Probe):
    """The per-module probe of watched steps. The root's hooks of every step (the forward's time,
    the model's mode, the batch) are root_hooks.py's."""

    def __init__(self, model: nn.Module, on_error, fused: bool | None = None, check_no_grad: bool = False):
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
        # A module's forward ran as torch.compile'd code (set by its pre-hook as Dynamo traced
        # it): hooks seen by Dynamo no longer come and go (watch).
        self.compiled = False
        # Also check forward passes under no_grad (the replay of a step runs under no_grad).
        self.check_no_grad = check_no_grad
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
        # Forward passes with no rec.step() after them (a long evaluation loop) must not grow
        # memory without bound: past this many calls in one step, calls go unchecked.
        self.max_calls = 64 * len(self.names) + 1024
        self._unmeasured = np.zeros(0, dtype=np.float32)  # the row of a step not watched: -1s
        self.meas = Measurements(fused)  # (fused: RecorderConfig.fused_reductions)
        # Fused steps (reductions/fused.py): modules seen writing into their inputs (and those that
        # say inplace=True), measured before they run; modules whose outputs are written in place
        # after they return, measured as they return.
        self.call_sites = CallSites(MAX_SITE_CALLS)  # the calls of a module called more than once
        self.writes_input = {i for i, m in enumerate(self.modules) if getattr(m, "inplace", False) is True}
        self.written_after: set[int] = set()
        self._reset()

    def histogram_modules(self, modules: list[int]) -> None:
        """Histogram these modules' outputs on histogram steps (histograms.histogram_tensors)."""
        self.hist_modules = {m: k for k, m in enumerate(modules)}

    def sample_outputs(self, samples, modules: dict[int, str]) -> None:
        """Hand these modules' outputs to ``samples`` on sample steps (blackbox/captures.py)."""
        self.samples, self.sample_modules = samples, modules

    # -- the probe protocol (probe.py) --------------------------------------------------------
    def arm(self, plan: StepPlan) -> None:
        self.sample_activations = plan.activations
        self.sample_histograms = plan.histograms
        self.sample_tensors = plan.tensors
        if plan.watched or self.watching:  # (from one plain step to the next nothing changes)
            self.watch(plan.watched)

    def rows(self, plan: StepPlan, host: dict) -> dict:
        """The output shapes and call sites first seen this step (finish_step makes the step's
        per-module rows: the origin of a NaN needs them before they are rows)."""
        return {"module_outputs": self.take_new_shapes(), "call_sites": self.call_sites.take_new_sites()}

    def close(self) -> None:
        self.remove()

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
        """Hook every module (a watched step), or none (other steps: root_hooks.py's only)."""
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
                if i == 0:  # the root's run eagerly under torch.compile (wrapped_functions.eager)
                    pre, post = eager(pre), eager(post)
                self._handles.append(m.register_forward_pre_hook(pre, prepend=True))
                self._handles.append(m.register_forward_hook(post))
        elif not on and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []

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
        self.meas.reset()  # the checks and statistics of the step (reductions/fused.py)
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

    def pack(self, packer: Packer, plan: StepPlan | None = None) -> None:
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
        faults = bool(bad.any() or neg_inf.any())
        amax = absmax.tolist()
        out_absmax, origin, consumer, neg_origin, batch_bad = born_where(
            self._calls, amax, bad.tolist(), neg_inf.tolist(), faults, n_modules, self._inside)
        out_absmax = np.array(out_absmax)
        # (per-call statistics only where no call's rows were dropped as stale: their order holds)
        per_call = self.call_sites.finish(step, self._calls, amax,
                                          self._acts if self._acts and not any(self.meas.stale_parts) else None,
                                          np.array(self.meas.numel), acts)
        row = {
            "output_absmax": out_absmax.astype(np.float32),
            "origin": origin,
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
