"""The loss function's operations that can make NaN/Inf, named from its autograd graph.

The recorder lists the autograd nodes between the loss and the model's outputs on a step that
went NaN/Inf (recorder/blackbox/loss_graph.py: ``LogBackward0``, ``SqrtBackward0``, ...). Of those, only a
few ops can turn finite values into NaN/Inf: in the forward pass those undefined or overflowing
on part of their domain, in the backward pass those whose derivative is unbounded at a point
(d/dx log x = 1/x at 0, d/dx sqrt x = 1/(2 sqrt x) at 0, the norm of a zero vector, acos at +-1).
"""

from __future__ import annotations

import re

# autograd node (without "Backward<n>") -> the op as a user writes it
_RISKY = {
    "Log": "log", "Log2": "log2", "Log10": "log10", "Log1p": "log1p", "Xlogy": "xlogy",
    "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Pow": "pow", "Reciprocal": "reciprocal", "Div": "division",
    "Acos": "acos", "Asin": "asin", "Atanh": "atanh", "Atan2": "atan2",
    "Norm": "norm", "LinalgVectorNorm": "norm", "Cdist": "cdist", "Pdist": "pdist", "Dist": "dist",
    "Std": "std", "StdMean": "std", "Lgamma": "lgamma", "Digamma": "digamma",
    "BinaryCrossEntropy": "binary_cross_entropy",
}
_FORWARD_ONLY = {"Exp": "exp", "Expm1": "expm1", "Sinh": "sinh", "Cosh": "cosh",
                 "NllLoss": "nll_loss", "NllLoss2D": "nll_loss"}  # (mean over 0 targets: 0/0)
_NODE = re.compile(r"^(.*?)Backward\d*$")


def _base(node: str) -> str:
    node, _, exponent = node.partition(":")
    m = _NODE.match(node)
    base = m.group(1) if m else node
    if base == "Pow" and exponent:
        # x ** e with a known exponent: its derivative e x^(e-1) is bounded for e = 0 or e >= 1
        try:
            e = float(exponent)
        except ValueError:
            return base
        return "Pow" if 0 < e < 1 or e < 0 else "PowBounded"
    return base


def risky_ops(ops: list[str], forward: bool) -> list[str]:
    """The loss's ops that can make NaN/Inf from finite values (in its forward pass too, with
    ``forward``: exp overflowing), each once, in the order met from the loss."""
    found = []
    for node in ops:
        base = _base(node)
        name = _RISKY.get(base) or (_FORWARD_ONLY.get(base) if forward else None)
        if name and name not in found:
            found.append(name)
    return found


def clause(ops: list[str] | None, forward: bool) -> str:
    """'; the loss function uses log, which ... (it takes the log of a softmax, ...)' or ''."""
    if not ops:
        return ""
    risky = risky_ops(ops, forward)
    if not risky:
        return ""
    at = "at +-1" if set(risky) & {"acos", "asin", "atanh"} else "at 0"
    what = ("which can make NaN/Inf from finite values" if forward else
            f"whose derivative can be infinite ({at})")
    text = f"; the loss function uses {', '.join(risky)}, {what}"
    pattern = _pattern(ops, forward)
    if pattern:
        text += f" ({pattern[0]})"
    return text


def advice(ops: list[str] | None) -> str:
    """Advice for the loss's own ops, to go before the general advice ('' if none)."""
    pattern = _pattern(ops or [], True)
    if pattern:
        return pattern[1] + " "
    risky = set(risky_ops(ops or [], True))
    if risky & {"sqrt", "rsqrt", "norm", "cdist", "pdist", "dist", "std"}:
        return ("The loss takes a square root (sqrt, a norm or a distance) whose derivative is infinite at 0: "
                "add eps inside it (sqrt(x + 1e-12)) or use the squared distance. ")
    if "division" in risky or "reciprocal" in risky:
        return "The loss divides by a value that can reach 0: clamp the denominator (x.clamp_min(eps)). "
    return ""


def _pattern(ops: list[str], forward: bool) -> tuple[str, str] | None:
    """(what the loss does, the fix) for the commonest ways a loss makes NaN/Inf, or None."""
    bases = [_base(o) for o in ops]
    if forward and ("NllLoss" in bases or "NllLoss2D" in bases) and "Log" not in bases:
        return ("a cross_entropy or nll_loss whose every target is ignore_index is a mean over 0 "
                "targets, 0/0 = NaN",
                "If every target of a batch can be ignore_index (padding, masked tokens), skip such batches "
                "or divide the summed loss by max(count, 1).")
    if "Log" in bases and ("Softmax" in bases or "Sigmoid" in bases):
        inner = "softmax" if "Softmax" in bases else "sigmoid"
        fix = ("F.log_softmax(x) or F.cross_entropy on the logits" if inner == "softmax"
               else "F.logsigmoid(x) or BCEWithLogitsLoss on the logits")
        return (f"it takes the log of a {inner}, which underflows to exactly 0 where the logits are far apart",
                f"Replace log({inner}(x)) with {fix}: they never take log(0).")
    return None
