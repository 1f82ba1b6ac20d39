"""The black box: what the model looked like just before it broke. Armed from the start, it
keeps references (no copies) to each step's forward inputs, buffers and RNG states; the first
time a gradient, the loss or an output goes NaN/Inf (or the job leaves by an exception or
SIGTERM) it writes the parameters as they were before the bad update, those inputs, the affected
gradients and optimizer state, and the RNG states; and it can replay the step on a copy of the
model to find the module where the NaN/Inf was born (replay.py). Stored as whole_tensors.py stores
every tensor: raw bytes, a row each, nothing pickled."""

from __future__ import annotations

import json
import operator
import random

import numpy as np
import torch
from torch import nn

from ..forward.wrapped_functions import eager
from ..profiler.profile_windows import own_work
from .replay import replay_step
from .whole_tensors import blob_task, host_copy, state_tensors


def _flatten(obj, prefix: str, tensors: list, scalars: dict, depth: int = 0) -> None:
    """Tensors of a forward's (args, kwargs), named by their path; plain values go to scalars."""
    if isinstance(obj, torch.Tensor):
        tensors.append((prefix, obj.detach()))
    elif depth > 4:
        return
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:64]):
            _flatten(v, f"{prefix}.{i}", tensors, scalars, depth + 1)
    elif isinstance(obj, dict):
        for k, v in list(obj.items())[:64]:
            _flatten(v, f"{prefix}.{k}", tensors, scalars, depth + 1)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        scalars[prefix] = json.dumps(obj)[:200]


class BlackBox:
    """Holds, at no copy, what a step's failure needs; copies it out only when a step breaks.

    Every step: references to the model's own forward inputs (the tensors the training holds
    anyway; up to MAX_CALLS root forwards per step), torch's RNG states at the step's first
    forward (CPU, and CUDA of the model's device) while the training may draw random numbers
    (see check_rng), and the buffers then (a foreach copy). Nothing is copied
    until a trigger; then the state, inputs, optimizer state of the affected parameters, their
    gradients and the RNG states are copied to the host once and written."""

    MAX_CALLS = 16
    # Watched steps in a row that drew no random numbers before the RNG states stop being read
    # on the other steps (the first 100 steps watch every 10th: from step ~30 on).
    RNG_STEADY_STEPS = 3

    def __init__(self, model: nn.Module, on_error):
        self.model = model
        self.on_error = on_error
        self.armed = True
        self.inputs: list[tuple[tuple, dict]] = []
        self.step_calls: list[tuple[str, tuple]] = []  # (keep_step_call)
        self.shared: dict = {}
        self.rng: dict | None = None
        # Reading the RNG states costs ~20 us at a step's first forward, cold (two tensors made;
        # measured on benchmarks/' MLP), and a step that draws no random numbers (no dropout,
        # no random op) replays the same from any state. So they are read on every step until
        # RNG_STEADY_STEPS watched steps have shown that a step leaves them as they were, and
        # then on watched steps only, which keep checking: one step seen drawing (dropout
        # switched on later, say) brings the reads back for good. Set by arm().
        self.take_rng = True
        self.rng_free = False
        self._rng_steady = 0
        self._rng_drawn = False
        self._rng_skipped = False  # this step's were not read (taken at capture() instead)
        # Buffers change in the forward (BatchNorm running statistics): their values at the step's
        # first forward are copied into these, preallocated on their device (a few KB for most
        # models: one foreach copy per step, no allocation).
        self._buffers: list[tuple[str, torch.Tensor]] = []
        self._buffer_copies: list[torch.Tensor] = []
        self._buffers_at_start = False
        self._buffer_slots: list | None = None
        self._buffer_objs: list = []  # the buffers (or None) in their slots when last taken
        self._buffer_sources: list[torch.Tensor] = []
        # model.to(device) keeps the Parameter objects: the first one tells the model's device
        self._first_param = next(iter(model.parameters()), None)
        # (run eagerly under torch.compile: the inputs, RNG states and buffers kept as without it)
        self._handle = model.register_forward_pre_hook(eager(self._pre_forward), with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()
        self.inputs = []

    def _pre_forward(self, module, args, kwargs):
        if not self.armed or not torch.is_grad_enabled():
            return None
        try:  # never raise into the model's forward
            with own_work():
                self._observe(args, kwargs)
        except Exception as e:
            self.on_error(e)
        return None

    def keep_step_call(self, method: str, args: tuple, shared: dict | None = None) -> None:
        """A framework's own entry into the step and its arguments, kept by reference for the
        replay and the box: Lightning's ``training_step(batch, batch_idx)``, which may call a
        child of the module rather than its forward. ``shared``: objects the replay's copy must
        not copy (id -> what the copy holds instead; the Trainer -> None)."""
        if not self.armed:
            return
        with own_work():
            if not self.inputs and not self.step_calls:
                self._start_of_step()
            if len(self.step_calls) < self.MAX_CALLS:
                self.step_calls.append((method, tuple(args)))
            self.shared = dict(shared or {})

    def _start_of_step(self) -> None:
        """What the step's first call starts from: the RNG states and the buffers."""
        if self.take_rng:
            self.rng = _rng_states(self._first_param)
        else:
            self._rng_skipped = True
        if self._buffer_slots != []:  # (None until found, at the first step)
            self._copy_buffers()

    def _observe(self, args, kwargs) -> None:
        if not self.inputs and not self.step_calls:
            self._start_of_step()
        if len(self.inputs) < self.MAX_CALLS:
            # Detached (shallowly): an input that carries an autograd graph (a GAN's generated
            # batch) must not keep that graph alive through us.
            if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # most models
                self.inputs.append(((args[0].detach(),), {}))
            else:
                self.inputs.append((tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                    {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}))
        return None

    def arm(self, watched: bool) -> None:
        """Watched steps read the RNG states and check them; others read them until the job is
        seen not to draw (see take_rng)."""
        self.take_rng = watched or not self.rng_free

    def check_rng(self) -> None:
        """At the end of a step whose RNG states were read at its first forward (a watched
        step): did the step draw random numbers since? See take_rng."""
        if self.rng is None or self._rng_drawn:
            return
        now = _rng_states(self._first_param)
        if now.keys() == self.rng.keys() and all(torch.equal(now[k], self.rng[k]) for k in now):
            self._rng_steady += 1
            self.rng_free = self._rng_steady >= self.RNG_STEADY_STEPS
        else:
            self._rng_drawn, self.rng_free = True, False

    def _copy_buffers(self) -> None:
        if self._buffer_slots is None:  # (module, name) of each persistent buffer, found once
            self._buffer_slots = []
            for prefix, m in self.model.named_modules(remove_duplicate=False):
                skip = getattr(m, "_non_persistent_buffers_set", set())
                self._buffer_slots += [(m, n) for n, b in m._buffers.items() if b is not None and n not in skip]
        # Every step: the buffer objects, checked by identity in C (model.to() and .half()
        # replace them). Python over each buffer's shape, dtype and device, as this did before,
        # cost ~0.1 ms right after a training step on the CNN of benchmarks/ (measured). Not
        # seen: a buffer whose .data is swapped for another dtype or device in place (copy_
        # converts it into the old copy).
        now = [m._buffers.get(n) for m, n in self._buffer_slots]
        if len(now) != len(self._buffer_objs) or not all(map(operator.is_, now, self._buffer_objs)):
            self._take_buffers(now)  # first step, or buffers replaced: allocate once more
        if self._buffer_copies:
            with torch.no_grad():
                try:
                    torch._foreach_copy_(self._buffer_copies, self._buffer_sources)
                except RuntimeError:  # a buffer resized in place: allocate again
                    self._take_buffers(now)
                    torch._foreach_copy_(self._buffer_copies, self._buffer_sources)
        self._buffers_at_start = True

    def _take_buffers(self, now: list) -> None:
        self._buffer_objs = now
        self._buffers = [(n, t) for (_, n), t in zip(self._buffer_slots, now)
                         if t is not None and not (t.is_sparse or t.is_quantized or t.is_complex())]
        self._buffer_sources = [t for _, t in self._buffers]
        self._buffer_copies = [torch.empty_like(t) for t in self._buffer_sources]

    def replay(self) -> dict:
        """This step's forward passes run again on a copy of the model, every module checked
        (replay.py): where its NaN/Inf was born."""
        calls = [(m, a, {}) for m, a in self.step_calls] or [("", a, k) for a, k in self.inputs]
        return replay_step(self.model, calls, self.rng,
                           self._buffers if self._buffers_at_start else [], self._buffer_copies, self.shared)

    def new_step(self) -> None:
        self.inputs = []
        self.step_calls = []
        self.rng = None
        self._rng_skipped = False
        self._buffers_at_start = False

    def capture(self, step: int, trigger: str, params_at: str, optimizer=None, bad: list[str] = (),
                param_names: dict | None = None, extra: dict | None = None):
        """Copy everything now; return the writer task. Disarms the box (it fires once)."""
        self.armed = False
        items: list[tuple[str, str, torch.Tensor]] = []
        seen: dict[int, torch.Tensor] = {}
        # Before the bad update the buffers are taken as they were at the step's first forward.
        start = dict(zip((id(t) for _, t in self._buffers), self._buffer_copies)) \
            if params_at == "start_of_step" and self._buffers_at_start else {}
        for key, t, role in state_tensors(self.model):
            c = seen.get(id(t))
            c = host_copy(start.get(id(t), t)) if c is None else c
            if c is not None:
                seen[id(t)] = c
                items.append((key, role, c))
        scalars: dict[str, str] = {}
        n_calls = len(self.inputs)
        calls = [(f"forward{i}", args, kwargs) for i, (args, kwargs) in enumerate(self.inputs)]
        calls += [(f"{method}{i}", args, {}) for i, (method, args) in enumerate(self.step_calls)]
        for call, args, kwargs in calls:
            found: list = []
            _flatten(tuple(args), f"{call}.args", found, scalars)
            if kwargs:
                _flatten(dict(kwargs), f"{call}.kwargs", found, scalars)
            for name, t in found:
                c = host_copy(t)
                if c is not None:
                    items.append((name, "input", c))
        # A step whose states were not read drew no random numbers up to here (check_rng): they
        # are those of its first forward.
        rng = dict(self.rng) if self.rng is not None else _rng_states(self._first_param) if self._rng_skipped else {}
        rng["numpy"], rng["python"] = np.random.get_state(), random.getstate()  # as they are now
        for name, t in rng_tensors(rng).items():
            items.append((f"rng.{name}", "rng", t))
        opt_info = {}
        if optimizer is not None and param_names:
            opt_info = {"optimizer": type(optimizer).__name__, "param_groups": _groups(optimizer, param_names)}
            for p in [p for g in optimizer.param_groups for p in g["params"]]:
                name = param_names.get(id(p))
                if name is None or name not in bad:
                    continue
                if p.grad is not None:
                    c = host_copy(p.grad)
                    if c is not None:
                        items.append((f"grad.{name}", "grad", c))
                for k, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        c = host_copy(v)
                        if c is not None:
                            items.append((f"optimizer.{name}.{k}", "optimizer", c))
                    elif isinstance(v, (int, float, bool)):
                        scalars[f"optimizer.{name}.{k}"] = json.dumps(v)
        detail = {"trigger_detail": extra or {}, "affected": list(bad)[:1000], "forward_calls": n_calls,
                  "step_calls": [m for m, _ in self.step_calls],
                  "values": scalars, **opt_info,
                  # when rng.torch (and rng.cuda) were read: at the step's first forward, or here,
                  # for a step that drew no random numbers up to here as far as the watched steps
                  # showed (check_rng); "none": no forward was seen this step
                  "rng_at": "first_forward" if self.rng is not None else "capture" if self._rng_skipped else "none"}
        row = {"step": step, "trigger": trigger, "params_at": params_at,
               "detail": json.dumps(detail, default=str)[:1_000_000]}
        return blob_task("blackbox", step, items, {"blackbox": row})


def _groups(optimizer, param_names: dict) -> list[dict]:
    """Hyperparameters of each param group (numbers, strings, booleans), and its parameters."""
    out = []
    for g in optimizer.param_groups:
        d = {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, type(None)))}
        d["params"] = [param_names.get(id(p), "?") for p in g["params"]][:1000]
        out.append(d)
    return out


def _rng_states(first_param: torch.Tensor | None) -> dict:
    """torch's (and CUDA's, for a model on a GPU) RNG states as they are now: ~1 us, the small
    byte tensors torch returns. (numpy's and Python's take 40-60 us to read: they are read only
    when the black box fires.)"""
    out = {"torch": torch.get_rng_state()}
    if first_param is not None and first_param.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(first_param.device)
    return out


def rng_tensors(states: dict) -> dict[str, torch.Tensor]:
    out = {k: states[k] for k in ("torch", "cuda") if k in states}
    if "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        out["numpy.keys"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).copy())
        out["numpy.pos_has_gauss_gauss"] = torch.tensor([float(pos), float(has_gauss), float(gauss)],
                                                        dtype=torch.float64)
    if "python" in states:
        version, state, gauss_next = states["python"]
        out["python"] = torch.tensor(list(state), dtype=torch.int64)
    return out
