"""The one `info` finding a detector gives when the trace lacks the data it needs."""

from __future__ import annotations

from ..findings import Finding
from ..trace import RankTrace

_NO_GRADIENTS_ADVICE = (
    "Call rec.step(loss=loss) after optimizer.step() and before the next optimizer.zero_grad(): "
    "zero_grad() sets the gradients to None, and the recorder reads them in rec.step()."
)


def no_gradients(rt: RankTrace, kind: str) -> list[Finding]:
    """[info finding] if no step of the trace holds any gradient, else []."""
    if rt.n_steps == 0 or len(rt.param_names) == 0:
        return []
    if not rt.digest.grad_absent.all():
        return []
    return [Finding(
        kind, "info", None, [],
        f"{kind} not checked: no parameter had a gradient when rec.step() was called, "
        f"in any of the {rt.n_steps:,} steps.",
        {"steps": rt.n_steps, "parameters": len(rt.param_names)}, _NO_GRADIENTS_ADVICE,
    )]
