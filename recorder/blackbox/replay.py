"""Find the module where a NaN/Inf was born by running the bad step's forward passes again.

Every module is checked only on watched steps (forward/module_watcher.py). When a step that was not
watched turns out bad (a NaN/Inf loss or gradient, seen on that step by the loss and gradient
norms), the black box still holds what that step's forward passes started from: the model's inputs,
torch's RNG states and the buffers at the step's first forward, and (before the optimizer's update)
the parameters themselves. Running those forward passes again on a copy of the model, with every
module hooked, tells which module's output went non-finite while its inputs were finite, as a
watched step would have.

The user's model is never touched: the copy is a ``copy.deepcopy`` that runs the user's hooks
(shared, not copied: the step ran them) but none of ours, it runs eagerly (a compiled model's
copy too) under ``no_grad`` inside ``torch.random.fork_rng`` (the training's RNG streams are
left where they were), and it is dropped afterwards. It costs one
copy of the model and one forward pass, once per run (the black box fires once); when that
forward is finite, one more forward and backward on the copy tells whether the NaN/Inf gradient
was born in the model's backward or came from the loss's. A model that
cannot be deep-copied (a module holding non-leaf tensors), or a copy that does not reproduce the
NaN/Inf, leaves the origin to the next watched step. A distributed model (DDP, FSDP2) is not
replayed: its forward would wait for the other ranks; its inputs are checked instead.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import nn

from ..distributed.sharding import is_sharded, local
from ..forward.module_watcher import ModuleWatcher
from ..reductions.stats import Packer, floating_tensors

def replay_step(model: nn.Module, calls: list, rng: dict | None, buffers: list, buffer_copies: list,
                shared: dict | None = None) -> dict:
    """Run the step's calls [(method, args, kwargs), ...] on a copy of ``model`` (method "": its
    forward; "training_step": a LightningModule's) whose buffers are ``buffer_copies`` (the
    values of ``buffers`` at the step's first call), from the RNG states ``rng``; ``shared``:
    objects the copy does not copy (id -> what it holds instead). Return the watcher's row for
    that step (output_absmax per module, origin, batch_nonfinite), ``reproduced`` (it went
    non-finite again) and ``replay``: what happened, in words. Only a reproduced row describes
    the step."""
    if not calls:
        return {"replay": "no forward call of the model was seen on this step (the training step called none of "
                          "the model's own forward: a child module instead?)"}
    inputs = [(a, k) for _, a, k in calls]
    if _distributed(model):
        # Its forward would talk to the other ranks (FSDP2 gathers its shards, DDP syncs
        # buffers), which are not replaying: a hang. Only the inputs are checked.
        if any(not bool(torch.isfinite(local(t)).all())
               for args, kwargs in inputs for t in floating_tensors((args, kwargs), limit=64)):
            return {"origin": -1, "batch_nonfinite": 1, "reproduced": True,
                    "replay": "the input batch (a distributed model is not replayed; its inputs were checked)"}
        return {"replay": "not replayed: the forward of a distributed (DDP, FSDP2) model talks to the other ranks"}
    memo = {id(t): c.clone() for (_, t), c in zip(buffers, buffer_copies)}
    memo.update(shared or {})
    _keep_user_hooks(model, memo)
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as e:
        return {"replay": f"the model could not be copied ({type(e).__name__}: {e})"[:500]}
    errors: list[BaseException] = []  # a failing check of the copy is reported, not raised
    watcher = ModuleWatcher(twin, errors.append, check_no_grad=True)
    watcher.watch(True)
    first = next(iter(twin.parameters()), None)
    cuda = first is not None and first.device.type == "cuda"
    try:
        with _step_rng(rng, first, cuda), _eager(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the copy's training_step logs with no Trainer: it warns)
            with torch.no_grad():
                for method, args, kwargs in calls:
                    (getattr(twin, method) if method else twin)(*args, **kwargs)
            pk = Packer()
            watcher.pack(pk)
            row = watcher.finish_step(pk.fetch(), len(watcher.names))
    except Exception as e:
        return {"replay": f"the replay raised {type(e).__name__}: {e}"[:500]}
    finally:
        watcher.remove()
    if errors:
        return {"replay": f"checking the copy failed ({type(errors[0]).__name__}: {errors[0]})"[:500]}
    found = row["origin"] >= 0 or bool(row["batch_nonfinite"])
    row["reproduced"] = found
    row["replay"] = ("reproduced: " + (f"module {watcher.names[row['origin']]!r}" if row["origin"] >= 0
                                      else "the input batch") if found else
                     "not reproduced: every module output of the replayed forward was finite")
    if not found and not any(method for method, _, _ in calls):  # (a training step's outputs are its loss)
        row.update(_backward_from_outputs(twin, inputs, rng, first, cuda))
        if "replay_backward" in row:
            row["replay"] += "; " + row["replay_backward"]
    return row


def _keep_user_hooks(model: nn.Module, memo: dict) -> None:
    """The copy runs the user's hooks, as the step did (a hook that rewrites an output makes the
    NaN the replay must see), not this package's (they would record into the live trace, or add
    a micro-batch's loss to the Hugging Face callback's). The user's hook functions are shared,
    not copied (a hook bound to a logger does not copy the logger); each is called with the
    copy's modules, tensors and arguments."""
    for m in model.modules():
        dicts = {k: v for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)}
        ours = {key for v in dicts.values() for key, fn in v.items() if _is_ours(fn)}
        for v in dicts.values():
            kept = type(v)((key, fn) for key, fn in v.items() if key not in ours)
            for fn in kept.values():
                memo[id(fn)] = fn
            memo[id(v)] = kept


def _is_ours(fn) -> bool:
    return str(getattr(fn, "__module__", None) or "").startswith("torchautopsy.")


def _eager():
    """The copy runs eagerly even if the model was compiled in place (``model.compile()``), so
    that every module's hook measures it."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _step_rng(rng: dict | None, first, cuda: bool):
    """torch's RNG streams as they were at the step's first forward, the training's own left
    where they were (fork_rng restores them on exit)."""
    with torch.random.fork_rng(devices=[first.device] if cuda else []):
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            if cuda and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], first.device)
        yield


def _distributed(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return any(isinstance(m, DistributedDataParallel) for m in model.modules()) or \
        any(map(is_sharded, model.parameters()))



def _backward_from_outputs(twin: nn.Module, inputs: list, rng: dict | None, first, cuda: bool) -> dict:
    """The step's forward was finite: was its NaN/Inf gradient born in the model's backward or
    did it come from the loss's? Run the forward again with autograd on the copy and send a
    finite gradient (ones) back from its outputs: if every parameter's gradient stays finite, the
    model's backward cannot have made the NaN/Inf, so the gradient the loss sent to the outputs
    was non-finite already (``output_grad_nonfinite`` 1, as a watched step measures it); if some
    go non-finite, the model's own backward makes it (0)."""
    try:
        for p in twin.parameters():
            p.grad = None
        with _step_rng(rng, first, cuda), _eager(), torch.enable_grad():
            outs = [t for args, kwargs in inputs
                    for t in floating_tensors(twin(*args, **kwargs), limit=64) if t.requires_grad]
            if not outs:
                return {}
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        grads = [p.grad for p in twin.parameters() if p.grad is not None]
        if not grads:
            return {}
        made = any(not bool(torch.isfinite(g).all()) for g in grads)
    except Exception as e:
        return {"replay_backward": f"the backward replay raised {type(e).__name__}: {e}"[:300]}
    return {"output_grad_nonfinite": 0 if made else 1,
            "replay_backward": ("the model's backward made NaN/Inf from a finite gradient at its outputs" if made
                                else "the model's backward stayed finite from a finite gradient at its outputs")}
