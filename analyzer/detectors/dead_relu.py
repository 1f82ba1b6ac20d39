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

from ..display import ordinal
from ..findings import Evidence as BaseEvidence, Finding
from ..trace import RankTrace
from ..trace.site_tables import unit_layout


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


class Evidence(BaseEvidence, total=False):
    window_steps: list  # [first, last] step of the latest window the site was judged in
    activation: str  # the activation function: ReLU, ReLU6, LeakyReLU or GELU
    units: int  # the site's units (channels or features)
    dead_units: int  # its units never positive in that window
    dead_share: float  # dead_units / units (0..1)
    dead_since_start: int  # dead units never positive in any judged window
    died_during_training: int  # dead units that were positive in an earlier window
    first_death_step: int  # the first step the earliest of those was dead from (None: none died)
    first_death_between: list  # [first, last] step: that death happened in this span (None: none died)
    median_death_step: int  # the median step they died at (None: none died)
    unit_dim: int  # the dimension of the activation's output that indexes its units
    negative_slope: float  # (LeakyReLU) the slope its negative region's gradient is scaled by
    call: int  # which call of the activation in its module during a step (0: the first)
    calls: int  # how many such calls the module makes in a step (a module called twice: 2 sites)


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
    scan = _scan_windows(rt, sites, cfg)
    findings = []
    for j, row in enumerate(sites.itertuples()):
        if scan.latest_end[j] < 0 or scan.latest_share[j] < cfg.warning_share:
            continue
        findings.append(_finding(rt, row, _site_deaths(scan, j), cfg))
    return findings


@dataclass(frozen=True)
class _Scan:
    """Every window streamed through, per judged site (j) and per unit of the sites in a row."""

    bounds: np.ndarray  # site j's units are bounds[j]:bounds[j + 1]
    ever_alive: np.ndarray  # per unit: positive in some judged window
    last_alive_start: np.ndarray  # per unit: first step of the last window it was positive in, or -1
    last_alive_end: np.ndarray  # ... and its last step
    first_cross: np.ndarray  # per site: start of the window its dead share last reached warning_share, or -1
    latest_start: np.ndarray  # per site: its latest judged window's first step, or -1
    latest_end: np.ndarray  # ... its last step
    latest_share: np.ndarray  # ... the share of the site's units dead in it
    latest_alive: np.ndarray  # per unit: positive in its site's latest judged window


def _scan_windows(rt: RankTrace, sites, cfg: DeadReluConfig) -> _Scan:
    site_of_unit, bounds = unit_layout(sites)
    n_units, n_sites = len(site_of_unit), len(sites)
    ever_alive = np.zeros(n_units, dtype=bool)
    last_alive_end = np.full(n_units, -1, dtype=np.int64)
    last_alive_start = np.full(n_units, -1, dtype=np.int64)
    first_cross = np.full(n_sites, -1, dtype=np.int64)
    # A window with no watched step judges nothing: each site keeps its latest judged one.
    lat_start = np.full(n_sites, -1, dtype=np.int64)
    lat_end = np.full(n_sites, -1, dtype=np.int64)
    lat_share = np.full(n_sites, np.nan)
    lat_alive = np.zeros(n_units, dtype=bool)
    units, sites_ix = np.arange(n_units), np.arange(n_sites)
    # A block of windows at a time, each state as after its windows one by one: a unit's last
    # alive window, a site's last judged one, and its dead share's last crossing since it last
    # fell below warning_share (a judged window under it resets; windows not judged do not).
    for starts, ends, judged, alive, share in rt.dead_unit_blocks(sites, cfg.min_seen_share):
        w = np.arange(len(starts), dtype=np.int32)[:, None]
        last = _last_true(alive)  # per unit: its last alive window here
        was = last >= 0
        last_alive_end[was], last_alive_start[was] = ends[last[was]], starts[last[was]]
        ever_alive |= was
        crossed = judged & (share >= cfg.warning_share)
        reset = np.where(judged & ~crossed, w, -1).max(axis=0, initial=-1)
        after = np.where(crossed & (w > reset), w, len(starts)).min(axis=0, initial=len(starts))
        fresh = np.where(after < len(starts), starts[np.minimum(after, len(starts) - 1)], -1)
        first_cross = np.where((reset >= 0) | (first_cross < 0), fresh, first_cross)
        lj = np.where(judged, w, -1).max(axis=0, initial=-1)  # per site: its last judged window here
        has = lj >= 0
        lat_start[has], lat_end[has], lat_share[has] = starts[lj[has]], ends[lj[has]], share[lj[has], sites_ix[has]]
        unit_lj = lj[site_of_unit]
        lat_alive = np.where(unit_lj >= 0, alive[np.maximum(unit_lj, 0), units], lat_alive)
    return _Scan(bounds, ever_alive, last_alive_start, last_alive_end, first_cross,
                 lat_start, lat_end, lat_share, lat_alive)


def _last_true(x: np.ndarray) -> np.ndarray:
    """Per column of a windows x units block, the last row holding True (-1: none). Most units
    are alive in a block's last window: only the others are searched."""
    last = np.where(x[-1], len(x) - 1, -1) if len(x) else np.full(x.shape[1], -1)
    rest = np.flatnonzero(last < 0)
    if rest.size and len(x) > 1:
        w = np.arange(len(x) - 1, dtype=np.int32)[:, None]
        last[rest] = np.where(x[:-1, rest], w, -1).max(axis=0, initial=-1)
    return last


@dataclass(frozen=True)
class _SiteDeaths:
    """One site's dead units in its latest judged window, and when they died."""

    start: int  # that window's first step
    end: int  # ... and last
    share: float  # share of the site's units dead in it
    step: int  # the finding's step: since when the dead share stayed at or above warning_share
    dead: int  # units dead in the window
    from_init: int  # ... of them never positive in any judged window
    died: int  # ... of them positive in an earlier window
    first_death: int | None  # the first step the earliest of those was dead from
    first_death_after: int | None  # ... the first step of its last window alive: it died in between
    median_death: int | None  # the median step they died at


def _site_deaths(scan: _Scan, j: int) -> _SiteDeaths:
    start, end = int(scan.latest_start[j]), int(scan.latest_end[j])
    u = slice(scan.bounds[j], scan.bounds[j + 1])
    dead = ~scan.latest_alive[u]
    from_init = dead & ~scan.ever_alive[u]
    died = dead & scan.ever_alive[u]
    died_at = scan.last_alive_end[u][died] + 1  # first step of the window after the last alive one
    return _SiteDeaths(
        start=start, end=end, share=float(scan.latest_share[j]),
        step=int(scan.first_cross[j]) if scan.first_cross[j] >= 0 else start,
        dead=int(dead.sum()), from_init=int(from_init.sum()), died=int(died.sum()),
        first_death=int(died_at.min()) if died.any() else None,
        # a unit is known to have fired somewhere in its last active window only
        first_death_after=int(scan.last_alive_start[u][died].min()) if died.any() else None,
        median_death=int(np.median(died_at)) if died.any() else None)


def _finding(rt: RankTrace, row, d: _SiteDeaths, cfg: DeadReluConfig) -> Finding:
    fn = row.function
    # Only a (capped) ReLU's dead units get no gradient at all: LeakyReLU leaks, GELU is near 0.
    severity = "error" if d.share >= cfg.error_share and fn in ("relu", "relu6", "hardtanh") else "warning"
    evidence = {
        "window_steps": [d.start, d.end],
        "activation": _LABEL.get(fn, fn),
        "units": int(row.units),
        "dead_units": d.dead,
        "dead_share": d.share,
        "dead_since_start": d.from_init,
        "died_during_training": d.died,
        "first_death_step": d.first_death,
        "first_death_between": [d.first_death_after, d.first_death] if d.died else None,
        "median_death_step": d.median_death,
        "unit_dim": int(row.unit_dim),
    }
    if fn == "leaky_relu":
        evidence["negative_slope"] = float(row.param)
    evidence["call"], evidence["calls"] = int(row.call), _calls(rt, row)
    return Finding(KIND, severity, d.step, [row.module], _summary(rt, row, d, cfg), evidence, _advice(d))


def _summary(rt: RankTrace, row, d: _SiteDeaths, cfg: DeadReluConfig) -> str:
    fn = row.function
    n, call = _calls(rt, row), int(row.call)
    if _is_activation_module(rt, row):  # (an nn.ReLU: one F.relu a call; several calls, several sites)
        how = "" if n == 1 else f", its {ordinal(call + 1)} call of {n} in a step"
    else:
        how = f" (F.{fn} in its forward)" if n == 1 else f" (its {ordinal(call + 1)} F.{fn} call of {n} in a step)"
    state = {"leaky_relu": "never left the negative (leaky) region",
             "gelu": "were pinned at or below zero"}.get(fn, "never activated")
    summary = (f"{d.dead} of {int(row.units)} units ({d.share:.0%}) of the {_LABEL.get(fn, fn)} in "
               f"{row.module or '(model)'}{how} {state} during steps {d.start}-{d.end}")
    parts = []
    if d.from_init:
        parts.append(f"{d.from_init} since the start")
    if d.died:
        parts.append(f"{d.died} died during training, the first between steps {d.first_death_after} "
                     f"and {d.first_death}")
    summary += f": {', '.join(parts)}." if parts else "."
    if d.died and d.step > d.first_death:
        # Units die one by one; the finding dates when the dead share reached the threshold.
        summary += f" At least {cfg.warning_share:.0%} of the units have been dead since step {d.step}."
    if fn == "leaky_relu":
        summary += f" Their gradient is scaled by the slope {row.param:g}."
    return summary


def _advice(d: _SiteDeaths) -> str:
    if d.from_init and d.died:
        return _ADVICE_DIED + " " + _ADVICE_INIT
    return _ADVICE_DIED if d.died >= d.from_init else _ADVICE_INIT


def _is_activation_module(rt: RankTrace, row) -> bool:
    """True if the site is an activation module's own call (nn.ReLU -> F.relu)."""
    mtype = rt.module_types[int(row.module_index)] if 0 <= int(row.module_index) < len(rt.module_types) else ""
    return mtype in ("ReLU", "ReLU6", "LeakyReLU", "GELU", "Hardtanh")


def _calls(rt: RankTrace, row) -> int:
    """How many sites of this function the module has: its calls in a step."""
    sites = rt.activity_sites
    return max(1, int(((sites["module_index"] == row.module_index) & (sites["function"] == row.function)).sum()))


def _no_data(rt: RankTrace) -> Finding:
    return Finding(KIND, "info", None, [],
                   "dead_relu not checked: this trace has no per-unit activity (recorded by "
                   "torchautopsy 0.1.0 or later with activity tracking).",
                   {}, "Record again with a current torchautopsy; activity tracking is on by default.")
