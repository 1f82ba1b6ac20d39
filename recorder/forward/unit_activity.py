"""Per-unit activity of activation functions, accumulated on the device over a window of steps.

For every call site of a ReLU-family function or GELU (an ``nn.ReLU`` module calls ``F.relu``,
so module and function calls are one mechanism, see wrapped_functions.py), each unit — a feature of
a Linear output, a channel of a convolution — gets one bit per window: was its output ever
positive. The bit is the running OR of ``amax over everything but the unit dimension > 0``,
one reduction per call. A ReLU unit whose bit stays 0 is dead; for LeakyReLU it only ever
leaked; for GELU its output was pinned at or below zero. Tanh and sigmoid sites instead count
the share of outputs within 1% of their bounds (saturated).

Each call keeps its maximum; at rec.step() the step's maxima are folded into the window's bits
in a few ops for all sites (accumulate), and the bits cross to the host once per window, through
the step's single transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..probe import Probe, StepPlan
from ..reductions.stats import Packer
from .wrapped_functions import call_arg

_UNIT_FUNCS = {"relu", "relu6", "leaky_relu", "gelu", "hardtanh"}
_SATURATING = {"tanh", "sigmoid"}
# Activation modules that compute with a tanh or sigmoid inside (see _inside_activation).
_OTHER_ACTIVATIONS = ("gelu", "silu", "swish", "mish", "softplus", "glu", "activation")
# Saturated: within 1% of the bound, |tanh| > 0.99 or sigmoid < 0.005 / > 0.995.
SATURATION_LEVEL = 0.99
# A site with more units than this is not tracked per unit (a flattened map, not a layer).
MAX_UNITS = 1 << 16
# Module types whose 3-D outputs are (batch, channels, length): their units are on dim 1.
_CHANNELS_FIRST = ("Conv", "BatchNorm", "InstanceNorm", "MaxPool", "AvgPool", "AdaptiveAvgPool",
                   "AdaptiveMaxPool", "LPPool", "Upsample", "ConvTranspose")


@dataclass
class _Site:
    index: int
    function: str
    unit_dim: int
    units: int
    bit_offset: int
    saturated: torch.Tensor | None = None  # float32 count of saturated outputs this window
    numel: int = 0
    seen_step: int = -1
    steps_seen: int = 0


class ActivityTracker(Probe):
    def __init__(self, watcher, window: int):
        self.watcher = watcher
        self.window = window
        self.sites: dict[tuple[int, str, int], _Site] = {}
        self.step = 0
        self._window_start = 0
        self._windows_done = 0
        self.last_step = self._last_step()  # the current window's last step (window_ends)
        # Steps of the current window whose modules were hooked (watched, see module_watcher.py): the
        # sites are only seen on those steps.
        self.steps_watched = 0
        self._bits = 0
        self._new_sites: list[dict] = []
        # The step's per-call maxima over all but the unit dimension, and the window's bits (one
        # uint8 per unit of every site, at its bit_offset) on the device: accumulate().
        self._tops: list[tuple[_Site, torch.Tensor]] = []
        self._window_bits: torch.Tensor | None = None
        self._index: tuple[tuple, torch.Tensor] | None = None  # (sites called, their bit positions)
        self._ending = False  # the step being recorded ends a window (pack, rows)

    # -- the probe protocol (probe.py) --------------------------------------------------------
    def arm(self, plan: StepPlan) -> None:
        self.step = plan.step

    def pack(self, pk: Packer, plan: StepPlan) -> None:
        """The step's calls folded into the window's bits; at a window's end, its bits and
        counts in the step's one transfer. (Recorded steps only: a plain step never ends a window,
        nor is watched.)"""
        if plan.watched:  # (the window's sites are seen on watched steps only)
            self.steps_watched += 1
        self.accumulate()
        self._ending = self.window_ends(plan.step)
        if self._ending:
            self._pack_window(pk)

    def rows(self, plan: StepPlan, host: dict) -> dict:
        rows = {"activity": self.finish_window(plan.step, host)} if self._ending else {}
        self._ending = False
        rows["activity_sites"] = self.take_new_sites()
        return rows

    def align(self, step: int) -> None:
        """Windows count from ``step``; sites seen in this first forward were first seen there."""
        self._window_start = self.step = step
        self.last_step = self._last_step()
        for site in self._new_sites:
            site["first_step"] = max(site["first_step"], step)

    # -- called by the wrapped functions, inside forward -------------------------------------
    def on_activation(self, fn: str, args, kwargs, out) -> None:
        frame = self.watcher.current()
        if frame is None or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        if fn == "hardtanh":  # nn.ReLU6 is hardtanh(0, 6); other hardtanh are not ReLU-like
            lo = call_arg(args, kwargs, 1, "min_val", -1.0)
            if lo != 0.0:
                return
        key = (frame[0], fn, self.watcher.next_call(frame, 1))
        site = self.sites.get(key)
        with torch.no_grad():  # (no detach needed under no_grad: no graph is recorded)
            y = out
            if site is None:
                site = self._new_site(key, args, kwargs, y)
                if site is None:
                    return
            if site.seen_step != self.step:
                site.seen_step = self.step
                site.steps_seen += 1
            if site.units:
                if y.dim() == 0 or y.shape[site.unit_dim] != site.units:
                    return
                dims = [d for d in range(y.dim()) if d != site.unit_dim]
                self._tops.append((site, y.amax(dim=dims) if dims else y))  # (folded at rec.step: accumulate)
            elif fn in _SATURATING:
                z = y.abs() if fn == "tanh" else (2 * y - 1).abs()
                n = (z > SATURATION_LEVEL).sum(dtype=torch.float32)
                site.saturated = n if site.saturated is None else site.saturated + n
                site.numel += y.numel()

    def _new_site(self, key, args, kwargs, y: torch.Tensor) -> _Site | None:
        module, fn, call = key
        units, unit_dim = 0, 0
        if fn in _UNIT_FUNCS and y.dim() >= 1:
            unit_dim = self._unit_dim(args, y)
            units = int(y.shape[unit_dim])
            if units > MAX_UNITS:
                units = 0
        elif fn not in _SATURATING or self._inside_activation(module, fn):
            return None
        site = _Site(len(self.sites), fn, unit_dim, units, self._bits)
        self._bits += units
        self.sites[key] = site
        param = math.nan
        if fn == "leaky_relu":
            param = float(call_arg(args, kwargs, 1, "negative_slope", 0.01))
        elif fn == "hardtanh":
            param = float(call_arg(args, kwargs, 2, "max_val", 1.0))
        self._new_sites.append({
            "module": module, "function": fn, "call": call, "param": param,
            "unit_dim": unit_dim, "units": units, "bit_offset": site.bit_offset,
            "first_step": self.step,
        })
        return site

    def _inside_activation(self, module: int, fn: str) -> bool:
        """The tanh or sigmoid is a part of another activation (GPT-2's NewGELUActivation computes
        GELU with a tanh, SiLU is x * sigmoid(x)): a weightless leaf module whose class names
        another activation. Its saturation is that function's shape, not a saturated layer."""
        w = self.watcher
        name = w.types[module].lower()
        return w.is_leaf[module] and not w.has_weights[module] and fn not in name \
            and any(k in name for k in _OTHER_ACTIVATIONS)

    def _unit_dim(self, args, y: torch.Tensor) -> int:
        if y.dim() <= 2:
            return y.dim() - 1
        if y.dim() >= 4:
            return 1  # (N, C, H, W), (N, C, D, H, W): channels
        x = args[0] if args else None
        producer = self.watcher.producer(x) if isinstance(x, torch.Tensor) else -1
        if producer < 0:  # inside a module (nn.ReLU): its input came from the module before
            producer = self.watcher.producer(y)
        if producer >= 0 and type(self.watcher.modules[producer]).__name__.startswith(_CHANNELS_FIRST):
            return 1
        return 2

    # -- called at rec.step() ----------------------------------------------------------------
    def window_ends(self, step: int) -> bool:
        return step >= self.last_step

    def _last_step(self) -> int:
        """Windows grow 5, 10, 20, 40 steps, then `window` each: early deaths (a too-high
        learning rate kills units within a few steps) are dated to within a few steps, and
        'dead from the start' means never positive in the first 5 steps."""
        return self._window_start + min(self.window, 5 * 2 ** self._windows_done) - 1

    def accumulate(self) -> None:
        """Fold the step's calls into the window's bits, a few ops for every site at once (call
        under no_grad): a unit is alive if its maximum was > 0, or NaN (a unit whose output went
        NaN is not dead). A site called twice in a step ORs (the max of its bits)."""
        if not self._tops:
            return
        tops, self._tops = self._tops, []
        called = tuple(s.index for s, _ in tops)
        dev = tops[0][1].device
        if self._index is None or self._index[0] != called or self._index[1].device != dev:
            where = [s.bit_offset + k for s, _ in tops for k in range(s.units)]
            self._index = (called, torch.tensor(where, dtype=torch.long, device=dev))
        top = torch.cat([t.to(dev) for _, t in tops])
        alive = ((top > 0) | top.isnan()).to(torch.uint8)
        bits = self._window_bits
        if bits is None or bits.numel() < self._bits or bits.device != dev:  # new sites: wider
            grown = torch.zeros(self._bits, dtype=torch.uint8, device=dev)
            if bits is not None:
                grown[: bits.numel()] = bits.to(dev)
            self._window_bits = bits = grown
        bits.scatter_reduce_(0, self._index[1], alive, "amax")

    def _pack_window(self, pk: Packer) -> None:
        """Add the window's bits and counts to this step's one host transfer."""
        self.accumulate()
        if self._window_bits is not None:
            pk.add("activity_bits", self._window_bits)
        sat = [s.saturated for s in self.sites.values() if s.saturated is not None]
        if sat:
            pk.add("activity_sat", sat)

    def finish_window(self, step: int, host: dict) -> dict:
        """The activity row of the window ending at this step; starts the next window."""
        sites = list(self.sites.values())
        bits = np.zeros(self._bits, dtype=bool)
        if "activity_bits" in host:
            bits[: host["activity_bits"].size] = host["activity_bits"] > 0
        sat = iter(host.get("activity_sat", ()))
        frac = np.full(len(sites), np.nan, dtype=np.float32)
        for s in sites:
            if s.saturated is not None:
                frac[s.index] = float(next(sat)) / max(s.numel, 1)
        row = {
            "step_start": self._window_start, "step_end": step,
            "steps_seen": np.array([s.steps_seen for s in sites], dtype=np.int32),
            "steps_watched": self.steps_watched,
            "ever_positive": np.packbits(bits, bitorder="little"),
            "saturated_frac": frac,
        }
        for s in sites:
            s.saturated, s.numel, s.steps_seen = None, 0, 0
        self._window_bits = None
        self._window_start = step + 1
        self._windows_done += 1
        self.last_step = self._last_step()
        self.steps_watched = 0
        return row

    def final_rows(self, step: int) -> dict | None:
        """At close: the rows of the last, partial window ending at ``step`` (a short run gets
        one too), or None if no step after the last written window was recorded."""
        if step < 0 or self._window_start > step:
            return None
        pk = Packer()
        with torch.no_grad():
            self._pack_window(pk)
            host = pk.fetch()
        return {"activity": self.finish_window(step, host), "activity_sites": self.take_new_sites()}

    def take_new_sites(self) -> list[dict]:
        new, self._new_sites = self._new_sites, []
        return new

