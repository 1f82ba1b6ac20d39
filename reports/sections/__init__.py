"""One module per finding kind: ``phrase(findings)`` says in a few words what went wrong (the
verdict chains these), ``figure_for(ctx, finding)`` draws the evidence. Kinds with no module
(analyzer_error, unreadable_rank, kinds added later) fall back to ``generic``."""

from __future__ import annotations

from . import (attention_collapse, dataloader_bottleneck, dead_relu, exploding_gradients, generic,
               loss_divergence, loss_plateau, memory_leak, nonfinite, out_of_memory, slow_steps, update_ratio,
               vanishing_gradients)

SECTIONS = {m.KIND: m for m in (nonfinite, exploding_gradients, vanishing_gradients, dead_relu,
                                attention_collapse, memory_leak, out_of_memory, loss_divergence, loss_plateau,
                                update_ratio, dataloader_bottleneck, slow_steps)}


def section(kind: str):
    return SECTIONS.get(kind, generic)
