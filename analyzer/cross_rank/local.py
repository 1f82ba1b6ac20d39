"""Which rank went wrong first when every rank shows a finding at the same step and stage:
after the gradient all-reduce every replica holds the same gradients, so what tells them apart
is local to each rank -- its own batch's loss. (Megatron checks the local gradient norm before
the data-parallel collective for the same reason; the recorder's norms are taken after it.)"""

from __future__ import annotations

import numpy as np

BEFORE = 20  # the steps before, whose median is a rank's usual loss
# A rank's loss this many times its usual (or below 1/x), and this many times further off than
# any other tied rank's, is the local cause: a batch of its own.
FACTOR = 1.5
APART = 2.0


def local_first(ranks: list[int], step: int, digests: dict) -> tuple[int, str] | None:
    """(rank, why) of the tied rank whose own loss at ``step`` was furthest off its usual, if
    one clearly was; None otherwise (nothing local tells them apart)."""
    scores = {}
    for r in ranks:
        d = digests.get(r)
        if d is None:
            return None
        i = int(np.searchsorted(d.steps, step))
        if i >= len(d.steps) or d.steps[i] != step or i < 3:
            return None
        before = np.abs(d.loss[max(0, i - BEFORE):i])
        usual = np.median(before[np.isfinite(before)]) if np.isfinite(before).any() else np.nan
        now = d.loss[i]
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
    return best, (f"every rank showed it at step {step:,}; rank {best}'s own loss there was {now:.4g} against "
                  f"{usual:.4g} over its {BEFORE} steps before, the other ranks' near their usual: its batch went "
                  f"wrong first")
