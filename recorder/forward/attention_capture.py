"""Attention statistics per layer and head, on sampled steps, without user help.

``nn.MultiheadAttention``: a forward pre-hook sees the call's own arguments. Called with
``need_weights=False`` (as ``nn.TransformerEncoderLayer`` calls it), the module hands its
projected query and key to ``F.scaled_dot_product_attention``, and the probabilities are taken
from that call; otherwise (or if that call is not seen) they are recomputed beside it from the
module's weights. Calls of
``F.scaled_dot_product_attention`` anywhere inside the model are seen by a wrapper (see
wrapped_functions.py) and named after the innermost module whose forward made them. Either way the
probabilities are computed from the same inputs, under ``no_grad``, on a slice of the batch
(attention_math.py); the model's own call runs exactly as it would without us. Under
``torch.compile`` nothing is captured: the hooks and the wrapper only call through while Dynamo
traces (see wrapped_functions.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..probe import Probe, StepPlan
from ..reductions.stats import Packer
from .attention_math import head_similarity_groups, head_stats_groups, mha_probs, sdpa_probs
from .wrapped_functions import call_arg, compiling

# Probability elements held for the step's one reduction (64 MB of float32): past it, the calls
# held so far are reduced at once (a long stack of layers with long sequences).
HELD_ELEMENTS = 1 << 24


class _Site:
    def __init__(self, index: int, heads: int, head_offset: int):
        self.index = index
        self.heads = heads
        self.head_offset = head_offset
        self.keys = 0


class AttentionTracker(Probe):
    def __init__(self, watcher, on_error):
        self.watcher = watcher
        self.on_error = on_error
        self.sampled = False
        self.step = 0
        self.sites: dict[tuple[int, str, int], _Site] = {}
        self._heads = 0
        self._new_sites: list[dict] = []
        # Module index -> (call, module, args, kwargs) of a MultiheadAttention call whose
        # probabilities are to come from the scaled_dot_product_attention call it makes: its own
        # projections, not a second pair of them (the query's and the key's: ~15% more matrix
        # products in the forward of benchmarks/'s transformer).
        self._pending: dict[int, tuple] = {}
        # The step's calls, (site, probabilities, allowed keys), reduced together at rec.step()
        # (or once they hold HELD_ELEMENTS): head_stats_groups over every call of one shape at
        # once, a fixed number of ops rather than ~50 a call. Then their results, in call order.
        self._calls: list[tuple[_Site, torch.Tensor, torch.Tensor | None]] = []
        self._held = 0
        self._stats: list[torch.Tensor] = []
        self._sims: list[torch.Tensor] = []
        self._order: list[_Site] = []
        self._handles = []
        for m in watcher.modules:
            if isinstance(m, nn.MultiheadAttention):
                self._handles.append(m.register_forward_pre_hook(self._make_mha_hook(), with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._mha_done, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pending = {}

    # -- the probe protocol (probe.py) --------------------------------------------------------
    def arm(self, plan: StepPlan) -> None:
        self.sampled = plan.activations
        self.step = plan.step

    def rows(self, plan: StepPlan, host: dict) -> dict:
        attn = self.finish_step(plan.step, host)
        return {**({"attention": attn} if attn is not None else {}), "attention_sites": self.take_new_sites()}

    def align(self, step: int) -> None:
        self.step = step
        for site in self._new_sites:  # seen in this first forward
            site["first_step"] = max(site["first_step"], step)

    def close(self) -> None:
        self.remove()

    def _make_mha_hook(self):
        def pre_hook(module, args, kwargs):
            if compiling() or not self.sampled:  # (not traced: see module_watcher.py)
                return None
            try:
                frame = self.watcher.current()
                if frame is None:
                    return None
                call = self.watcher.next_call(frame, 2)
                if not call_arg(args, kwargs, 4, "need_weights", True):
                    self._pending[frame[0]] = (call, module, args, kwargs)
                else:
                    self._mha(frame[0], call, module, args, kwargs)
            except Exception as e:
                self.on_error(e)
            return None

        return pre_hook

    def _mha(self, index: int, call: int, module, args, kwargs) -> None:
        """The probabilities recomputed from the module's weights and the call's arguments."""
        out = mha_probs(
            module, call_arg(args, kwargs, 0, "query"), call_arg(args, kwargs, 1, "key"),
            key_padding_mask=call_arg(args, kwargs, 3, "key_padding_mask"),
            attn_mask=call_arg(args, kwargs, 5, "attn_mask"),
            is_causal=bool(call_arg(args, kwargs, 7, "is_causal", False)),
            need_weights=bool(call_arg(args, kwargs, 4, "need_weights", True)),
            return_allowed=True,
        )
        if out is not None:
            self._observe((index, "MultiheadAttention", call), *out)

    def _mha_done(self, module, args, kwargs, output):
        """After a MultiheadAttention call: if it made no scaled_dot_product_attention call that
        was seen (another path of torch's), recompute its probabilities now. The weights are
        those of the call: a forward does not change them."""
        if compiling() or not self._pending:
            return None
        try:
            for index, pending in list(self._pending.items()):
                if pending[1] is module:
                    del self._pending[index]
                    self._mha(index, *pending)
        except Exception as e:
            self.on_error(e)
        return None

    def on_attention(self, fn: str, args, kwargs, out) -> None:
        """A call of F.scaled_dot_product_attention or F.softmax (from the wrappers in
        wrapped_functions.py)."""
        if not self.sampled:
            return
        frame = self.watcher.current()
        if frame is None:
            return
        if fn == "softmax":
            self._softmax(frame, args, kwargs, out)
            return
        if isinstance(self.watcher.modules[frame[0]], nn.MultiheadAttention):
            # MultiheadAttention's own call: its site, with the projections it made; without
            # need_weights=False its pre-hook has recomputed the probabilities already.
            pending = self._pending.pop(frame[0], None)
            if pending is None:
                return
            key = (frame[0], "MultiheadAttention", pending[0])
        else:
            key = (frame[0], "scaled_dot_product_attention", self.watcher.next_call(frame, 2))
        q, k = call_arg(args, kwargs, 0, "query"), call_arg(args, kwargs, 1, "key")
        res = sdpa_probs(
            q, k, attn_mask=call_arg(args, kwargs, 3, "attn_mask"),
            is_causal=bool(call_arg(args, kwargs, 5, "is_causal", False)),
            scale=kwargs.get("scale"), enable_gqa=bool(kwargs.get("enable_gqa", False)),
            return_allowed=True,
        )
        if res is not None:
            self._observe(key, *res)

    def _softmax(self, frame, args, kwargs, out) -> None:
        """A softmax over the last dim of a (batch, heads, queries, keys) tensor, called inside a
        module's forward (not nn.MultiheadAttention's own: seen by its hooks): attention written
        out by hand. Its output is the probabilities; the keys a row may attend to are those the
        mask left above half the dtype's lowest value (a mask adds -inf or finfo.min; a sharp
        but unmasked row keeps finite logits, whose probabilities may underflow to 0)."""
        x = call_arg(args, kwargs, 0, "input")
        dim = call_arg(args, kwargs, 1, "dim")
        if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.dim() == 4
                and dim in (-1, 3) and out.is_floating_point() and out.shape[-1] > 1):
            return
        if isinstance(self.watcher.modules[frame[0]], nn.MultiheadAttention):
            return
        call = self.watcher.next_call(frame, 2)
        with torch.no_grad():
            n = min(4, out.shape[0])  # (a slice of the batch, as for the other sources)
            logits = x[:n].detach()
            allowed = torch.isfinite(logits) & (logits > torch.finfo(logits.dtype).min / 2) \
                if logits.is_floating_point() else None
            self._observe((frame[0], "softmax", call), out[:n].detach().float(), allowed)

    def _observe(self, key, probs: torch.Tensor, allowed) -> None:
        site = self.sites.get(key)
        heads = int(probs.shape[1])
        if site is None:
            site = _Site(len(self.sites), heads, self._heads)
            self._heads += heads
            self.sites[key] = site
            self._new_sites.append({"module": key[0], "source": key[1], "call": key[2], "heads": heads,
                                    "head_offset": site.head_offset, "first_step": self.step})
        if heads != site.heads:
            return
        site.keys = int(probs.shape[-1])
        self._calls.append((site, probs, allowed))
        self._held += probs.numel()
        if self._held > HELD_ELEMENTS:
            self._reduce()

    def _reduce(self) -> None:
        """The statistics of the calls held, one head_stats_groups per shape of probabilities
        (and of allowed keys: a call whose mask has another shape goes alone)."""
        groups: dict[tuple, list] = {}
        for call in self._calls:
            _, probs, allowed = call
            full = allowed is None or allowed.shape == probs.shape
            key = (tuple(probs.shape), probs.dtype, probs.device, allowed is None, full, id(call) if not full else 0)
            groups.setdefault(key, []).append(call)
        with torch.no_grad():
            for calls in groups.values():
                probs = torch.stack([c[1] for c in calls]) if len(calls) > 1 else calls[0][1].unsqueeze(0)
                allowed = None
                if calls[0][2] is not None:
                    allowed = torch.stack([c[2] for c in calls]) if len(calls) > 1 else calls[0][2]
                self._stats.append(head_stats_groups(probs, allowed).reshape(-1))
                self._sims.append(head_similarity_groups(probs))
                self._order.extend(c[0] for c in calls)
        self._calls, self._held = [], 0

    # -- at rec.step() -----------------------------------------------------------------------
    def pack(self, pk: Packer, plan: StepPlan | None = None) -> None:
        self._reduce()
        if self._stats:
            pk.add("attn_stats", torch.cat(self._stats) if len(self._stats) > 1 else self._stats[0])
            pk.add("attn_sim", torch.cat(self._sims) if len(self._sims) > 1 else self._sims[0])

    def finish_step(self, step: int, host: dict) -> dict | None:
        self._pending = {}  # (left by a forward that raised inside the module)
        order, self._order, self._stats, self._sims = self._order, [], [], []
        self._calls, self._held = [], 0
        if not order or "attn_stats" not in host:
            return None
        n_sites = len(self.sites)
        # Several calls of one site in a step (shared layers) are averaged.
        sums = np.zeros((self._heads, 3))
        calls = np.zeros(n_sites)
        sim_sum = np.zeros(n_sites)
        stats, i = host["attn_stats"], 0
        for j, s in enumerate(order):
            sums[s.head_offset:s.head_offset + s.heads] += stats[i:i + 3 * s.heads].reshape(s.heads, 3)
            i += 3 * s.heads
            calls[s.index] += 1
            sim_sum[s.index] += host["attn_sim"][j]
        with np.errstate(invalid="ignore", divide="ignore"):
            per_head = np.repeat(calls, [s.heads for s in self.sites.values()])
            mean = sums / per_head[:, None]
            sim = (sim_sum / calls).astype(np.float32)
        keys = np.array([s.keys if calls[s.index] else 0 for s in self.sites.values()], dtype=np.int32)
        return {"step": step, "entropy": mean[:, 0].astype(np.float32), "max_weight": mean[:, 1].astype(np.float32),
                "sink_share": mean[:, 2].astype(np.float32), "head_similarity": sim, "keys": keys}

    def take_new_sites(self) -> list[dict]:
        new, self._new_sites = self._new_sites, []
        return new

