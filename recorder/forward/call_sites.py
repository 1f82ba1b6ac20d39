"""The outputs of a module called more than once in a step, call by call.

modules/output_absmax and activations/ hold one value per module and step, over all its calls:
right for most modules, but it hides what one call did in a module the forward calls several
times (torchvision's BasicBlock calls its one nn.ReLU twice, ALBERT runs one shared layer twelve
times, an RNN cell is looped over time). So on watched steps each call of such a module is a site
of its own: its max |output| every watched step, and its mean, std and zero share where the step's
activation statistics were taken. A module is made sites for at its first step with two calls or
more, and keeps them (a column of NaN on steps it ran once); calls past MAX_SITE_CALLS share the
last site, as the activity and attention sites do (module_watcher.next_call).
"""

from __future__ import annotations

import math

import numpy as np

from ..reductions.stats import combine_stats


class CallSites:
    def __init__(self, max_calls: int):
        self.max_calls = max_calls
        self.sites: dict[tuple[int, int], int] = {}  # (module, call) -> column
        self._new: list[dict] = []

    def take_new_sites(self) -> list[dict]:
        new, self._new = self._new, []
        return new

    def finish(self, step: int, calls: list, amax: list, acts: dict | None, numel, act_rows) -> dict | None:
        """The step's call_outputs row, or None when no module ran more than once. ``calls``: the
        watched calls in the order they returned, (module, input checks, output checks);
        ``amax``: max |x| of every check; ``acts``: module -> its statistics rows, one per call
        (None when the step took no statistics, or one of them was dropped as stale)."""
        counts: dict[int, int] = {}
        for module, _, _ in calls:
            counts[module] = counts.get(module, 0) + 1
        reused = {m for m, n in counts.items() if n > 1}
        if not reused and not self.sites:
            return None
        seen: dict[int, int] = {}
        absmax: dict[int, float] = {}  # column -> max |output| over its calls this step
        rows: dict[int, list[int]] = {}  # column -> statistics rows
        for module, _, outs in calls:
            if module not in reused and (module, 0) not in self.sites:
                continue
            k = seen.get(module, 0)
            seen[module] = k + 1
            key = (module, min(k, self.max_calls - 1))
            col = self.sites.get(key)
            if col is None:
                col = self.sites[key] = len(self.sites)
                self._new.append({"module": module, "call": key[1], "first_step": step})
            vals = [amax[o] for o in outs]
            a = math.nan if any(v != v for v in vals) else max(vals)
            prev = absmax.get(col)
            absmax[col] = a if prev is None else (math.nan if prev != prev or a != a else max(a, prev))
            if acts is not None and module in acts and k < len(acts[module]):
                rows.setdefault(col, []).append(acts[module][k])
        n = len(self.sites)
        out = np.full(n, -1.0, dtype=np.float32)  # -1: the site's call did not run this step
        for col, a in absmax.items():
            out[col] = a
        row = {"step": step, "output_absmax": out}
        if rows:
            mean, std, zero = combine_stats(n, rows, numel, act_rows)
            row.update(mean=mean.astype(np.float32), std=std.astype(np.float32), zero_frac=zero.astype(np.float32))
        else:
            row.update(mean=np.full(n, np.nan, np.float32), std=np.full(n, np.nan, np.float32),
                       zero_frac=np.full(n, np.nan, np.float32))
        return row
