"""What the loss function did with the model's outputs, read on a step that went NaN/Inf.

A NaN/Inf born in the loss function (a hand-written -log(softmax) underflowing, sqrt of a zero
distance) happens outside every module, so module hooks cannot name it. Two things can, at
almost no cost on healthy steps:

- The model's outputs on the real step. The root module's forward hook keeps weak references to
  its first outputs (a weak reference keeps no memory alive) and marks their autograd nodes
  (``Node.metadata``, ~0.3 us). When the loss comes back non-finite, outputs the training loop
  still holds (``out = model(x)`` usually lives until the next iteration) are checked: finite
  outputs and a non-finite loss mean the loss function made it, on the step itself, with no
  replay that might differ from it.
- The loss's own operations. The loss tensor given to ``rec.step()`` still has its autograd
  graph's nodes after backward (their saved values are freed; their types and edges are not):
  walking from the loss down to the marked output nodes lists the loss function's ops
  (``LogBackward0``, ``SqrtBackward0``, ``PowBackward0:0.5`` with its exponent, ...), which names
  the one whose derivative is unbounded.
"""

from __future__ import annotations

import weakref

import torch

from ..reductions.stats import floating_tensors

MARK = "torchautopsy_output"  # key set in the output nodes' metadata
MAX_OUTPUTS = 4
MAX_NODES = 2000  # a loss has a few dozen nodes (a weight penalty 2 a parameter): past this, give up


def mark_outputs(output) -> list:
    """Weak references to the forward's first floating outputs that carry a graph; their
    autograd nodes are marked as the model's outputs."""
    refs = []
    for x in floating_tensors(output, limit=MAX_OUTPUTS):
        node = x.grad_fn
        if node is not None:
            node.metadata[MARK] = True
            refs.append(weakref.ref(x))
    return refs


def outputs_nonfinite(refs: list) -> int:
    """1 if an output still alive holds NaN/Inf, 0 if every output was still alive and finite,
    -1 if not known (none seen, or one was already freed and the rest finite)."""
    alive = [r() for r in refs]
    if not alive:
        return -1
    held = [x for x in alive if x is not None]
    with torch.no_grad():
        if any(not bool(torch.isfinite(x).all()) for x in held):
            return 1
    return 0 if len(held) == len(alive) else -1


def loss_ops(loss) -> list[str] | None:
    """The loss function's autograd ops, from the loss towards the model's outputs (each type
    once, in the order met), or None if the walk did not reach a marked output node (the loss
    was not computed from this forward's outputs, or the graph is too big to be a loss's).
    An empty list: the loss is one of the model's outputs (computed inside the model)."""
    node = getattr(loss, "grad_fn", None)
    if node is None:
        return None
    ops: list[str] = []
    reached = False
    stack, seen, keep = [node], set(), []  # (keep: no id is reused while the walk runs)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        keep.append(n)
        if len(seen) > MAX_NODES:
            return None
        if MARK in n.metadata:
            reached = True
            continue
        name = type(n).__name__
        if name == "PowBackward0":  # x ** e: risky only for e < 1 (its saved exponent outlives backward)
            e = getattr(n, "_saved_exponent", None)
            if isinstance(e, (int, float)):
                name += f":{e:g}"
        if name != "AccumulateGrad" and name not in ops:  # (a parameter used in the loss)
            ops.append(name)
        stack.extend(f for f, _ in reversed(n.next_functions) if f is not None)
    return ops if reached else None
