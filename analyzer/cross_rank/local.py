"""Which rank went wrong first when every rank shows a finding at the same step and stage: after
the gradient all-reduce every replica holds the same gradients, so what tells them apart is local
to each rank -- its own gradients before the all-reduce (recorder/distributed/local_grads.py: Megatron checks
the local gradient norm before the data-parallel collective for the same reason), and its own
batch's loss."""

from __future__ import annotations

import numpy as np

from .light import BEFORE, near_at

# BEFORE (light.py): the steps before, whose median is a rank's usual value
# A rank's loss or local gradient norm this many times its usual (or below 1/x), and this many
# times further off than any other tied rank's, is the local cause.
FACTOR = 1.5
APART = 2.0


def local_first(ranks: list[int], step: int, digests: dict) -> tuple[int, str] | None:
    """(rank, why) of the tied rank that went wrong first by what is local to it, if one clearly
    did: the one whose own gradients held NaN/Inf before the all-reduce while the others' were
    finite, else the one whose own loss, else own gradient norm, was furthest off its usual.
    None if nothing local tells them apart."""
    at = {}
    for r in ranks:
        d = digests.get(r)
        w = None if d is None else (d.near.get(step) if hasattr(d, "near") else near_at(d, step))
        if w is None:
            return None
        at[r] = (d, w)
    grads = {r: w["local_grad"][-1] for r, (d, w) in at.items()}
    measured = [r for r in ranks if _measured(at[r][0])]
    bad = [r for r in measured if not np.isfinite(grads[r])]
    if measured == ranks and 0 < len(bad) < len(ranks):
        first = min(bad)  # (several: the lowest; the finding lists them all)
        others = [r for r in ranks if r not in bad]
        return first, (f"every rank showed it at step {step:,}; before the ranks' gradients were reduced together "
                       f"(all-reduce, reduce-scatter), rank {first}'s own gradients held {_what(grads[first])}" +
                       (f" (so did rank{'s' if len(bad) > 2 else ''} {', '.join(map(str, bad[1:]))})"
                        if len(bad) > 1 else "") +
                       f", rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}' were finite: "
                       f"its own backward went wrong first")
    for name, what in (("loss", "loss"), ("local_grad", "gradient norm before the ranks' reduction")):
        if name == "local_grad" and not (measured == ranks and not bad):
            break
        best = _off_usual({r: (w[name], w["i"]) for r, (d, w) in at.items()})
        if best is not None:
            r, now, usual = best
            return r, (f"every rank showed it at step {step:,}; rank {r}'s own {what} there was {now:.4g} against "
                       f"{usual:.4g} over its {BEFORE} steps before, the other ranks' near their usual: "
                       f"{'its batch' if name == 'loss' else 'its own backward'} went wrong first")
    return None


def _measured(d) -> bool:
    """Whether the rank's trace has local gradient norms (DDP, a recorder that takes them)."""
    if hasattr(d, "local_measured"):
        return d.local_measured
    return bool(np.isfinite(d.local_grad).any()) if len(d.local_grad) else False


def _what(v: float) -> str:
    return "NaN" if np.isnan(v) else "Inf"


def _off_usual(series: dict) -> tuple[int, float, float] | None:
    """(rank, value, usual) of the rank whose value at its index was clearly furthest off its
    usual (the median of its BEFORE values before), or None. ``series``: rank -> (its values up
    to the step, the BEFORE before and the step's last; the step's index among its steps)."""
    scores = {}
    for r, (window, i) in series.items():
        if i < 3:
            return None
        before, values, i = np.abs(window[:-1]), window, len(window) - 1
        usual = np.median(before[np.isfinite(before)]) if np.isfinite(before).any() else np.nan
        now = values[i]
        if not np.isfinite(now):
            scores[r] = (np.inf, now, usual)
        elif usual > 0 and np.isfinite(usual) and now != 0:
            scores[r] = (abs(np.log(abs(now) / usual)), now, usual)
        else:
            return None
    ordered = sorted(scores.items(), key=lambda kv: -kv[1][0])
    (best, (score, now, usual)), runner = ordered[0], ordered[1][1][0]
    if score < np.log(FACTOR) or not (score == np.inf and runner < np.inf or score > APART * runner):
        return None
    return best, now, usual
