"""dead_relu: a large share of a layer's units never activate over a window of steps.

Data: per activation call site (an nn.ReLU module, or F.relu/torch.relu called inside some
module's forward; also ReLU6, LeakyReLU, GELU), one bit per unit and window: was the output
ever positive (activity/, written every `activity_window` steps). Heuristic: in the latest
window, the share of units whose bit is 0 (among sites seen in at least `min_seen_share` of the
window's watched steps: the recorder hooks the modules every `activations_every`-th step). At `warning_share` or more it is a warning, at `error_share` an error.
Each dead unit is dead since initialisation (never positive in any window) or died at a step
(the first window after its last positive one). For LeakyReLU the units only leak (gradient
times the slope, noted); GELU is reported only when its outputs are pinned at or below zero,
and as a warning. Streams over windows: memory bounded by the number of units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Finding
from ..trace import RankTrace


@dataclass(frozen=True)
class DeadReluConfig:
    # Share of a layer's units that never output a positive value during the latest window
    # (activity_window steps, 50 by default). Healthy ReLU nets keep some dead units: 5-20% in
    # our healthy sample traces (measured) and in Lu et al. 2019 ("Dying ReLU and
    # initialization"); half or more of a layer is a layer that has mostly stopped learning.
    warning_share: float = 0.5
    error_share: float = 0.9
    # Layers narrower than this are not judged: 3 dead units of 4 is noise, not a trend.
    min_units: int = 8
    # A unit counts as dead only if its site ran in at least this share of the window's steps.
    min_seen_share: float = 0.5


KIND = "dead_relu"
REQUIRES = ("activity/ever_positive", "activity_sites/units")
CONFIG = DeadReluConfig  # its thresholds: a [dead_relu] table of analyze --config
ORDER = 40  # among findings of one step and stage, the detectors run (and list) in this order

_RELU_LIKE = {"relu", "relu6", "hardtanh", "leaky_relu", "gelu"}
_LABEL = {"relu": "ReLU", "relu6": "ReLU6", "hardtanh": "ReLU6", "leaky_relu": "LeakyReLU", "gelu": "GELU"}

_ADVICE_INIT = (
    "Units dead from the first steps point at initialisation or inputs: use Kaiming/He init "
    "for ReLU layers, do not initialise biases negative, normalise the inputs, or put a "
    "normalisation layer (BatchNorm/LayerNorm) before the activation."
)
_ADVICE_DIED = (
    "Units that died during training were usually pushed negative by large updates: lower the "
    "learning rate or add a warm-up, clip gradients, or use LeakyReLU/GELU so a negative unit "
    "still gets a gradient."
)


def detect(rt: RankTrace, cfg: DeadReluConfig) -> list[Finding]:
    sites = rt.activity_sites
    if len(sites) == 0:
        recorded = "activity_window" in rt.meta.get("config", {})
        return [] if recorded or rt.n_steps == 0 else [_no_data(rt)]
    sites = sites[sites["function"].isin(_RELU_LIKE) & (sites["units"] >= cfg.min_units)]
    if len(sites) == 0:
        return []

    # The judged sites' units, concatenated: per-unit state is kept in flat arrays and every
    # window is one vectorised update (a long run has tens of thousands of windows).
    offsets = sites["bit_offset"].to_numpy(dtype=np.int64)
    units = sites["units"].to_numpy(dtype=np.int64)
    site_of_unit = np.repeat(np.arange(len(sites)), units)
    bit_of_unit = np.concatenate([np.arange(o, o + u) for o, u in zip(offsets, units)])
    bounds = np.concatenate([[0], np.cumsum(units)])
    contiguous = bool(np.array_equal(bit_of_unit, np.arange(len(bit_of_unit))))  # the usual layout
    ever_alive = np.zeros(len(bit_of_unit), dtype=bool)
    last_alive_end = np.full(len(bit_of_unit), -1, dtype=np.int64)
    last_alive_start = np.full(len(bit_of_unit), -1, dtype=np.int64)
    first_cross = np.full(len(sites), -1, dtype=np.int64)
    site_rows = sites.index.to_numpy()
    # Per site, its latest judged window (a window with no watched step judges nothing):
    # start, end, dead share; and per unit, whether it was alive in it.
    lat_start = np.full(len(sites), -1, dtype=np.int64)
    lat_end = np.full(len(sites), -1, dtype=np.int64)
    lat_share = np.full(len(sites), np.nan)
    lat_alive = np.zeros(len(bit_of_unit), dtype=bool)
    for start, end, seen, bits, _, watched in rt.activity_windows():
        length = watched  # the steps of the window its sites could be seen on
        site_seen = np.where(site_rows < len(seen), np.asarray(seen)[np.minimum(site_rows, len(seen) - 1)], 0) \
            if len(seen) else np.zeros(len(sites))
        judged = (site_seen >= cfg.min_seen_share * length) & (length > 0)
        ours = bits[:len(bit_of_unit)] if contiguous else bits[bit_of_unit]
        alive = ours & judged[site_of_unit]
        last_alive_end[alive] = end
        last_alive_start[alive] = start
        ever_alive |= alive
        alive_count = np.concatenate([[0], np.cumsum(alive)])
        share = 1.0 - (alive_count[bounds[1:]] - alive_count[bounds[:-1]]) / units
        crossed = judged & (share >= cfg.warning_share)
        first_cross = np.where(crossed & (first_cross < 0), start, first_cross)
        first_cross = np.where(judged & ~crossed, -1, first_cross)  # recovered: only a share lasting to the end counts
        lat_start[judged], lat_end[judged], lat_share[judged] = start, end, share[judged]
        lat_alive = np.where(judged[site_of_unit], alive, lat_alive)

    findings = []
    for j, row in enumerate(sites.itertuples()):
        if lat_end[j] < 0 or lat_share[j] < cfg.warning_share:
            continue
        start, end = int(lat_start[j]), int(lat_end[j])
        u = slice(bounds[j], bounds[j + 1])
        alive, share = lat_alive[u], float(lat_share[j])
        dead = ~alive
        from_init = dead & ~ever_alive[u]
        died = dead & ever_alive[u]
        died_at = last_alive_end[u][died] + 1  # first step of the window after the last alive one
        fn = row.function
        label = _LABEL.get(fn, fn)
        severity = "error" if share >= cfg.error_share and fn in ("relu", "relu6", "hardtanh") else "warning"
        where = [row.module]
        how = "" if _is_module_call(rt, row) else f" (F.{fn} call {row.call} in its forward)"
        n_units = int(row.units)
        evidence = {
            "window_steps": [start, end],
            "activation": label,
            "units": n_units,
            "dead_units": int(dead.sum()),
            "dead_share": float(share),
            "dead_since_start": int(from_init.sum()),
            "died_during_training": int(died.sum()),
            "first_death_step": int(died_at.min()) if died.any() else None,
            # a unit is known to have fired somewhere in its last active window only
            "first_death_between": ([int(last_alive_start[u][died].min()), int(died_at.min())]
                                    if died.any() else None),
            "median_death_step": int(np.median(died_at)) if died.any() else None,
            "unit_dim": int(row.unit_dim),
        }
        if fn == "leaky_relu":
            evidence["negative_slope"] = float(row.param)
        state = "never activated" if fn != "leaky_relu" else "never left the negative (leaky) region"
        if fn == "gelu":
            state = "were pinned at or below zero"
        summary = (f"{int(dead.sum())} of {n_units} units ({share:.0%}) of the {label} in {row.module or '(model)'}"
                   f"{how} {state} during steps {start}-{end}")
        parts = []
        if from_init.any():
            parts.append(f"{int(from_init.sum())} since the start")
        if died.any():
            lo = int(last_alive_start[u][died].min())
            parts.append(f"{int(died.sum())} died during training, the first between steps {lo} "
                         f"and {int(died_at.min())}")
        summary += f": {', '.join(parts)}." if parts else "."
        step = first_cross[j] if first_cross[j] >= 0 else start
        if died.any() and step > int(died_at.min()):
            # Units die one by one; the finding dates when the dead share reached the threshold.
            summary += f" At least {cfg.warning_share:.0%} of the units have been dead since step {step}."
        if fn == "leaky_relu":
            summary += f" Their gradient is scaled by the slope {row.param:g}."
        advice = _ADVICE_DIED if died.sum() >= from_init.sum() else _ADVICE_INIT
        if from_init.any() and died.any():
            advice = _ADVICE_DIED + " " + _ADVICE_INIT
        findings.append(Finding(KIND, severity, int(step), where, summary, evidence, advice))
    return findings


def _is_module_call(rt: RankTrace, row) -> bool:
    """True if the site is the activation module's own call (nn.ReLU -> F.relu)."""
    mtype = rt.module_types[int(row.module_index)] if 0 <= int(row.module_index) < len(rt.module_types) else ""
    return mtype in ("ReLU", "ReLU6", "LeakyReLU", "GELU", "Hardtanh") and int(row.call) == 0


def _no_data(rt: RankTrace) -> Finding:
    return Finding(KIND, "info", None, [],
                   "dead_relu not checked: this trace has no per-unit activity (recorded by "
                   "torchautopsy 0.1.0 or later with activity tracking).",
                   {}, "Record again with a current torchautopsy; activity tracking is on by default.")
