"""Whole tensors in the trace: parameter snapshots and sampled activations and gradients (and the
helpers the black box, black_box.py, stores its tensors with).

Tensors are stored as their raw bytes (exact dtype, C order, native little-endian; bfloat16 as
its 16 bits) with a row per tensor in the ``tensors`` table: nothing is pickled. The copies to
the host are taken in the training thread (the tensors change at the next step); encoding and
writing happen in the writer thread.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import torch
from torch import nn

from ..distributed.sharding import local

# Half precision a snapshot may be stored in (snapshot_dtype); "exact" keeps each tensor's dtype.
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def state_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(key, tensor, role) of what ``model.state_dict()`` holds, keys spelled as it spells them:
    parameters and persistent buffers of every module, tied ones under each of their names.

    Walks the modules itself rather than calling state_dict(), which runs user hooks (and under
    FSDP collectives) at a moment the training does not expect them."""
    out = []

    def walk(m: nn.Module, prefix: str) -> None:
        for n, p in m._parameters.items():
            if p is not None:
                out.append((prefix + n, p, "param"))
        skip = getattr(m, "_non_persistent_buffers_set", set())
        for n, b in m._buffers.items():
            if b is not None and n not in skip:
                out.append((prefix + n, b, "buffer"))
        for n, c in m._modules.items():
            if c is not None:
                walk(c, prefix + n + ".")

    walk(model, "")
    return out


def host_copy(t: torch.Tensor, half: torch.dtype | None = None) -> torch.Tensor | None:
    """A contiguous CPU copy of t (floats in ``half`` if given), detached; None for tensors whose
    bytes cannot be stored (sparse, quantized, meta, complex)."""
    if t.is_sparse or t.is_quantized or t.device.type == "meta" or t.is_complex():
        return None
    t = local(t.detach())  # (a rank's shard of an FSDP2 parameter: distributed/sharding.py)
    if half is not None and t.is_floating_point() and t.dtype != half:
        t = t.to(half)
    # On CUDA this synchronises: it is only done on a sparse schedule or once (the black box).
    return t.to("cpu", copy=True).contiguous()


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as uint8 (bfloat16 and bool included)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, np.uint8)
    return flat.view(torch.uint8).numpy()


def tensor_row(source: str, step: int, name: str, role: str, t: torch.Tensor, location: str,
               offset: int, nbytes: int) -> dict:
    return {"source": source, "step": step, "name": name, "role": role, "dtype": dtype_name(t.dtype),
            "shape": json.dumps(list(t.shape)), "location": location, "offset": offset, "nbytes": nbytes}


def blob_task(source: str, step: int, items: list[tuple[str, str, torch.Tensor]], extra: dict | None = None):
    """A writer-thread task appending tensors (name, role, host tensor) to blobs/bytes."""

    def run(writer) -> dict:
        rows = []
        for name, role, t in items:
            data = raw_bytes(t)
            offset = writer.append_blob(data) if data.size else 0
            rows.append(tensor_row(source, step, name, role, t, "blobs", offset, int(data.size)))
        out = {"tensors": rows}
        if extra:
            out.update(extra)
        return out

    return run


class Snapshots:
    """Parameter (and buffer) snapshots in a ring of slots of fixed size in snapshots/bytes.

    The first snapshot (the weights at step 0) keeps slot 0 for the whole run; later ones take
    slots 1..n-1 in turn, each overwriting the oldest, so the bytes on disk never exceed
    ``budget`` (slot size = the first snapshot's size). A slot is written in place, then its
    row is appended: a kill in between leaves a row whose crc32 no longer matches (the reader
    reports that snapshot as torn)."""

    def __init__(self, model: nn.Module, every: int, budget: int, dtype: str):
        self.model = model
        self.every = every
        self.budget = budget
        self.half = HALF.get(dtype)
        self.dtype = dtype
        self.slot_bytes = 0
        self.n_slots = 0
        self.count = 0  # snapshots taken
        self.skipped = ""  # why snapshots stopped, if they did

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0 and not self.skipped

    def forget_unwritten(self) -> None:
        """The only snapshot taken was never written (a resumed attempt's opening one, whose step
        was not known): the next takes its slot."""
        if self.count == 1:
            self.count = 0

    def _nbytes(self, tensors) -> int:
        """The bytes a snapshot of these tensors takes, before copying anything."""
        total, seen = 0, set()
        for t in tensors:
            if id(t) in seen or t.is_sparse or t.is_quantized or t.is_complex():
                continue
            seen.add(id(t))
            size = self.half.itemsize if self.half is not None and t.is_floating_point() else t.element_size()
            total += t.numel() * size
        return total

    def take(self, step: int):
        """Copy the state now (the parameters at the start of ``step``); return the writer task,
        or None when the budget cannot hold it (then nothing is copied)."""
        state = state_tensors(self.model)
        nbytes = self._nbytes(t for _, t, _ in state)
        if nbytes == 0:
            return None  # a model without parameters or buffers: nothing to keep
        if self.count == 0:
            self.slot_bytes = max(nbytes, 1)
            self.n_slots = self.budget // self.slot_bytes
            if self.n_slots < 1:
                self.skipped = (f"one snapshot ({nbytes:,} bytes) exceeds snapshot_budget_bytes "
                                f"({self.budget:,})")
                return None
        elif nbytes > self.slot_bytes:
            self.skipped = f"the state grew to {nbytes:,} bytes, past the {self.slot_bytes:,}-byte slot"
            return None
        if self.count > 0 and self.n_slots < 2:
            return None  # room for the first snapshot only
        items = []
        seen: dict[int, torch.Tensor] = {}
        for key, t, role in state:
            c = seen.get(id(t))
            if c is None:
                c = host_copy(t, self.half)
                if c is None:
                    continue
                seen[id(t)] = c
            items.append((key, role, c))
        slot = 0 if self.count == 0 else 1 + (self.count - 1) % (self.n_slots - 1)
        self.count += 1
        base = slot * self.slot_bytes
        dtype = self.dtype

        def run(writer) -> dict:
            rows, placed, pos, crc = [], {}, 0, 0
            for key, role, c in items:
                if id(c) not in placed:  # tensor by tensor: no second copy of the whole state
                    data = raw_bytes(c)
                    writer.write_snapshot_bytes(base + pos, data)
                    crc = zlib.crc32(data, crc)
                    placed[id(c)] = (base + pos, int(data.size))
                    pos += data.size
                off, n = placed[id(c)]
                rows.append(tensor_row("snapshot", step, key, role, c, "snapshots", off, n))
            return {"tensors": rows, "snapshots": {"step": step, "slot": slot, "offset": base,
                                                   "nbytes": pos, "crc32": crc, "dtype": dtype}}

        return run


class Samples:
    """Activations and output gradients of a few modules on sampled steps, the first rows of
    the batch (dim 0) only, at most ``max_elements`` per tensor; at most ``budget`` bytes in all."""

    def __init__(self, every: int, max_rows: int, max_elements: int, budget: int, on_error):
        self.on_error = on_error
        self.every = every
        self.max_rows = max_rows
        self.max_elements = max_elements
        self.budget = budget
        self.bytes = 0
        self.pending: list[tuple[str, str, torch.Tensor]] = []
        self.count = 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0 and self.bytes < self.budget

    def _slice(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        if x.dim() == 0:
            return x
        rows = min(self.max_rows, x.shape[0])
        per_row = max(1, x[0].numel())
        rows = max(1, min(rows, self.max_elements // per_row))
        return x[:rows]

    def on_output(self, name: str, out: torch.Tensor) -> None:
        """Called from the forward hook of a sampled module on a sampled step."""
        c = host_copy(self._slice(out))
        if c is not None:
            self.pending.append((f"{name}.activation", "activation", c))
            self.bytes += c.numel() * c.element_size()
        if out.requires_grad:
            def grad_hook(g, name=name):  # observes the gradient; returns None: changes nothing
                try:  # never raise into the backward pass
                    c = host_copy(self._slice(g))
                    if c is not None:
                        self.pending.append((f"{name}.grad", "grad", c))
                        self.bytes += c.numel() * c.element_size()
                except Exception as e:
                    self.on_error(e)
            out.register_hook(grad_hook)

    def take(self, step: int):
        items, self.pending = self.pending, []
        if not items:
            return None
        self.count += 1
        return blob_task("sample", step, items)
