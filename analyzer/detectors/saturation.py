"""saturation: tanh or sigmoid units stuck at their bounds, where their gradient vanishes.

Data: per tanh/sigmoid call site, the share of its outputs within 1% of the bounds in each
activity window (activity/saturated_frac). Heuristic: in the latest window the share reaches
`share`: a warning, dated from the first window after which it stayed at or above it. Every
saturated site is one finding (one cause saturates them all), the first to saturate named first;
the function, share and windows in its evidence are that site's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace


@dataclass(frozen=True)
class SaturationConfig:
    # Share of a tanh/sigmoid's outputs within 1% of its bounds (|tanh| > 0.99, sigmoid < 0.005
    # or > 0.995) over the latest activity window. There the derivative is below 0.02: those
    # units barely learn (LeCun et al. 1998, "Efficient BackProp", on keeping tanh inputs in
    # its linear range; Glorot & Bengio 2010 saw the top sigmoid layer saturate). Healthy tanh
    # layers in our tests stay under 10% (measured).
    share: float = 0.5


class Evidence(BaseEvidence, total=False):
    function: str  # the activation: tanh or sigmoid
    saturated_share: float  # share of its outputs within 1% of its bounds in the latest window (0..1)
    threshold_share: float  # the share it is judged against (share, 0..1)
    window_steps: list  # [first, last] step of that window
    share_per_window: list  # [first step, last step, saturated share] of each of the last 20 windows
    layers: list  # every saturated site, first to saturate first: {module, function, saturated_share, since_step}


KIND = "saturation"
REQUIRES = ("activity/saturated_frac",)
CONFIG = SaturationConfig  # its thresholds: a [saturation] table of analyze --config
ORDER = 80  # among findings of one step and stage, the detectors run (and list) in this order

_ADVICE = (
    "Saturated tanh/sigmoid units pass almost no gradient (the derivative is below 0.02 there): "
    "scale the inputs (normalise the data, add LayerNorm/BatchNorm before the activation), use "
    "Xavier/Glorot initialisation, lower the learning rate, or switch hidden layers to ReLU/GELU. "
    "For an output sigmoid, compute the loss from logits (BCEWithLogitsLoss)."
)


def detect(rt: RankTrace, cfg: SaturationConfig) -> list[Finding]:
    sites = rt.activity_sites
    if len(sites) == 0:
        return []
    sites = sites[sites["function"].isin(("tanh", "sigmoid"))]
    if len(sites) == 0:
        return []
    history = {int(i): [] for i in sites.index}
    for start, end, _, _, frac, _ in rt.activity_windows():
        for i in history:
            history[i].append((start, end, float(frac[i]) if i < len(frac) else np.nan))
    found = []  # (since step, -share, module, function, history) per saturated site
    for row in sites.itertuples():
        h = history[int(row.Index)]
        if not h or not np.isfinite(h[-1][2]) or h[-1][2] < cfg.share:
            continue
        since = len(h) - 1
        while since > 0 and np.isfinite(h[since - 1][2]) and h[since - 1][2] >= cfg.share:
            since -= 1
        found.append((int(h[since][0]), -h[-1][2], str(row.module), str(row.function), h))
    if not found:
        return []
    # One cause (inputs or weights too large, a learning rate too high) saturates every such
    # layer: one finding, the layers listed, the first to saturate named first.
    found.sort(key=lambda f: (f[0], f[1]))
    since, _, module, function, h = found[0]
    start, end, share = h[-1]
    where = list(dict.fromkeys(m for _, _, m, _, _ in found))
    names = [f"{m or '(model)'} ({-s:.0%})" for _, s, m, _, _ in found]
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    fns = " and ".join(sorted({fn for _, _, _, fn, _ in found}))
    if len(found) == 1:
        summary = (f"{share:.0%} of the outputs of the {function} in {module or '(model)'} are saturated (within "
                   f"1% of its bounds) during steps {start}-{end}, and at least {cfg.share:.0%} since step "
                   f"{since}: those units barely learn.")
    else:
        summary = (f"The {fns} outputs of {len(found)} layers are saturated (within 1% of their bounds, at least "
                   f"{cfg.share:.0%} of them) in steps {start}-{end}: {listed}; the first since step {since}: "
                   f"those units barely learn.")
    evidence = {"function": function, "saturated_share": share, "threshold_share": cfg.share,
                "window_steps": [start, end], "share_per_window": [[a, b, round(f, 4)] for a, b, f in h[-20:]],
                "layers": [{"module": m, "function": fn, "saturated_share": round(-s, 4), "since_step": st}
                           for st, s, m, fn, _ in found[:200]]}
    return [Finding(KIND, "warning", since, where, summary, evidence, _ADVICE)]
