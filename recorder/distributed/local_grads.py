"""Each rank's own gradient, before DDP averages it with the other ranks'.

After the all-reduce every replica holds the same gradients: a NaN born in one rank's backward is
on every rank at the same step, and its norms cannot say which rank made it. Megatron checks the
local gradient norm before the data-parallel collective for this reason. Here DDP's own extension
point does it: a communication hook (``register_comm_hook``) that takes the norm of each gradient
bucket as this rank made it, one reduction per bucket (25 MiB of gradients by default), kept on
the device until the step's transfer, then runs DDP's default all-reduce (``allreduce_hook``,
documented to give the same result as no hook; the parameters stay bitwise the same, tested).

The hook is registered at the end of the first recorded step: DDP takes one hook, which a job
registers before its first backward, so by then a job's own hook is there (and this one stays
off) and a job never finds the slot taken by ours. The first step has no local norm. A DDP hook
cannot be removed: after close() it only runs the all-reduce.

FSDP2 has no such hook, but each parameter group's reduce-scatter is an object it calls
(``FSDPModule.set_custom_reduce_scatter``'s slot): at the same moment it is wrapped in one that
takes the norm of the flat gradients it is given (this rank's unsharded gradients, divided by
FSDP's pre-divide factor where FSDP divides first: the same factor on every rank) and then calls
the one it wraps, the job's own included.
"""

from __future__ import annotations

import math
import sys

import torch

from ..probe import Probe

OFF_REASONS = ("no DDP or FSDP2 module", "the job's own DDP communication hook", "DDP join with "
               "divide_by_initial_world_size=False", "registration failed")


def find_ddp(model):
    """The DistributedDataParallel module the Recorder was given (or one inside it), or None."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # (a torch built without distributed)
        return None
    return next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None) \
        if model is not None else None


def fsdp_param_groups(model) -> list:
    """The FSDP2 parameter groups of the model's fully_shard'ed modules (empty if none)."""
    # A module can be an FSDPModule only once the job has imported FSDP (fully_shard does):
    # importing it here would add ~0.5 s to every job's start.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    FSDPModule = getattr(fsdp, "FSDPModule", None)
    if FSDPModule is None:
        return []
    groups = []
    for m in model.modules() if model is not None else ():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups.extend(getattr(state, "_fsdp_param_groups", None) or [])
    return groups


class _MeasuredReduceScatter:
    """FSDP2's reduce-scatter, with the norm of its input taken first."""

    def __init__(self, inner, owner: "LocalGradients"):
        self._inner, self._owner = inner, owner

    def allocate(self, *args, **kwargs):
        return self._inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self._owner.measure(input_tensor)
        return self._inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                           async_op=async_op)

    def __getattr__(self, name):  # (anything else FSDP asks of its comm)
        return getattr(self._inner, name)


class LocalGradients(Probe):
    def __init__(self, model):
        self.ddp = find_ddp(model)
        self._model = model if self.ddp is None and fsdp_param_groups(model) else None
        self.pending: list[torch.Tensor] = []  # this step's bucket norms (0-d, on the device)
        self.on = False
        waiting = self.ddp is not None or self._model is not None
        self.status = "waiting" if waiting else OFF_REASONS[0]  # (the trace's local_grad_norms)

    @property
    def due(self) -> bool:
        """Whether attach() has something to do (called at the end of each step until it ran)."""
        return self.ddp is not None or self._model is not None

    def measure(self, grads) -> None:
        if self.on:
            try:
                self.pending.append(torch.linalg.vector_norm(grads, dtype=torch.float32))
            except Exception:
                self.on, self.status = False, "stopped: the norm failed"

    def attach(self) -> None:
        """Register the hook, unless the job has a hook of its own (or DDP would divide otherwise);
        under FSDP2 wrap each parameter group's reduce-scatter."""
        ddp, self.ddp = self.ddp, None  # (tried once)
        model, self._model = self._model, None
        if model is not None:
            try:
                for g in fsdp_param_groups(model):
                    if not isinstance(g._reduce_scatter_comm, _MeasuredReduceScatter):
                        g._reduce_scatter_comm = _MeasuredReduceScatter(g._reduce_scatter_comm, self)
            except Exception as e:  # (an FSDP2 of another torch: no local norms, training untouched)
                self.status = f"{OFF_REASONS[3]}: {type(e).__name__}"
                return
            self.on, self.status = True, "recorded"
            return
        if ddp is None:
            return
        try:
            if ddp._comm_hooks or ddp._get_ddp_logging_data().get("comm_hook"):
                self.status = OFF_REASONS[1]  # (mixed_precision= and fused optimizers register one too)
                return
            if getattr(ddp, "_divide_by_initial_world_size", True) is not True:
                self.status = OFF_REASONS[2]  # (DDP then divides by the ranks not yet joined; the hook could not)
                return
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            self._allreduce = allreduce_hook
            ddp.register_comm_hook(ddp.process_group, self._hook)
        except Exception as e:  # (a DDP of another torch: no local norms, training untouched)
            self.status = f"{OFF_REASONS[3]}: {type(e).__name__}"
            return
        self.on, self.status = True, "recorded"

    def _hook(self, process_group, bucket):
        self.measure(bucket.buffer())  # (before allreduce_hook divides it in place: the same stream, ordered)
        return self._allreduce(process_group, bucket)

    def stop(self) -> None:
        self.on = False
        self.pending = []

    def take(self) -> list[torch.Tensor]:
        """This step's bucket norms (and a fresh list for the next step)."""
        p, self.pending = self.pending, []
        return p

    def put_back(self, pending: list[torch.Tensor]) -> None:
        """Norms taken for a plain step that turned out bad: measured with the full step."""
        self.pending = pending

    def pack(self, pk, plan) -> None:
        local = self.take()
        if local:
            pk.add("local_grad", local)

    def close(self) -> None:
        self.stop()


def combine(values) -> float:
    """The local gradient norm from its buckets' norms (NaN if none; NaN/Inf if any bucket is)."""
    if not len(values):
        return math.nan
    return math.sqrt(sum(float(v) * float(v) for v in values))
