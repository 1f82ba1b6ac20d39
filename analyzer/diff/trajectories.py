"""Where two runs' trajectories part: the first step, and within it the first recorded value in
the order the step computes them (the batch, the forward in module order, the loss, the backward
from the last parameter to the first, the learning rate and the updated weights).

Two regimes. Runs of one seed and one data order (the batch of their first common step is the
same to the bit) are compared exactly: the first value that differs at all is where they part,
unless it differs by rounding only (under ``EXACT_TOLERANCE``: nondeterministic kernels), in which
case they are judged as the second regime. Runs of other seeds differ everywhere by noise: each
series' own noise is estimated from its step-to-step variation (the median |change| of its log,
both runs, per block of steps), and B parts from A where their log ratio stays beyond
``Z`` x that noise and at least ``MIN_RATIO`` x for ``SUSTAIN`` values in a row (a learning rate,
which has no noise: at its first difference). The steps are read a block at a time, both runs
aligned by step number, and reading stops once the earliest parting cannot move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..trace import RankTrace

EXACT_TOLERANCE = 1e-3  # relative: a first difference smaller than this is rounding, not a change
Z = 4.0  # how many of a series' noise the log ratio must stand beyond
MIN_RATIO = 2.0  # ... and at least this ratio: two seeds of one recipe differ by less (measured in tests)
SUSTAIN = 5  # values in a row (every-step series)
SUSTAIN_WATCHED = 3  # values in a row of a series recorded on watched steps only (module outputs)
# Parameters of fewer elements are not judged between seeds: the norm of a 1-element bias is that
# element, drawn anew by each seed and free to cross 0 (two healthy seeds: 0.68 and 3e-4).
MIN_NUMEL = 64
BLOCK = 1 << 14  # common steps read at a time
_STAGES = ("batch", "forward", "loss", "backward", "update")
_BATCH = (("input_mean", "mean"), ("input_std", "std"), ("input_max", "max"), ("input_min", "min"))


@dataclass(frozen=True)
class Parting:
    step: int
    stage: str  # batch | forward | loss | backward | update
    what: str  # "gradient norm of fc1.weight"
    where: list
    a: float
    b: float
    exact: bool  # found in the exact regime (the first value that differs at all)

    @property
    def ratio(self) -> float:
        with np.errstate(divide="ignore", invalid="ignore"):
            r = abs(self.b) / abs(self.a) if self.a != 0 else math.inf
        return float(r) if math.isfinite(r) else (math.inf if self.b != 0 else 1.0)


@dataclass(frozen=True)
class _Series:
    order: int  # position in the step's order
    stage: str
    what: str
    where: list
    sustain: int
    noiseless: bool  # (the learning rate: any difference is one)
    numel: int  # elements of the parameter (0: not a parameter's series)


class _Group:
    """Columns of one table both runs hold, in the step's order: A's and B's column index each."""

    def __init__(self, stage, series, cols_a, cols_b, table):
        self.stage, self.series, self.cols_a, self.cols_b, self.table = stage, series, cols_a, cols_b, table


def _groups(a: RankTrace, b: RankTrace) -> list[_Group]:
    groups = []
    order = 0
    pa = {p: k for k, p in enumerate(a.param_names)}

    def add(stage, items, read, sustain=SUSTAIN, noiseless=False):
        nonlocal order
        series = []
        for what, where in items:
            numel = int(a.param_numel[pa[where[0]]]) if where and where[0] in pa else 0
            series.append(_Series(order, stage, what, where, sustain, noiseless, numel))
            order += 1
        cols_a, cols_b, table = read
        # A group's series sit in A's column order, not the step's (each keeps its `order`): a
        # block is then the file's rows as read, not a reordered copy of them (the backward runs
        # the columns in reverse).
        keep = sorted(range(len(series)), key=lambda i: cols_a[i]) if table != "steps" else range(len(series))
        groups.append(_Group(stage, [series[i] for i in keep], [cols_a[i] for i in keep],
                             [cols_b[i] for i in keep], table))

    steps_cols = [(c, w) for c, w in _BATCH]
    add("batch", [(f"batch {w}", []) for _, w in steps_cols],
        ([c for c, _ in steps_cols], [c for c, _ in steps_cols], "steps"))
    # The forward: modules in definition order (a module's submodules before its own output
    # completes would be closer, but definition order is what a reader scans), the model last.
    mb = {m: k for k, m in enumerate(b.module_names)}
    mods = [(k, mb[m]) for k, m in enumerate(a.module_names) if k > 0 and m in mb]
    if a.module_names and a.module_names[0] in mb:
        mods.append((0, mb[a.module_names[0]]))
    add("forward", [(f"output of {a.module_names[k] or '(model)'} (max |x|)", [a.module_names[k]]) for k, _ in mods],
        ([k for k, _ in mods], [j for _, j in mods], "modules/output_absmax"), sustain=SUSTAIN_WATCHED)
    add("loss", [("loss", [])], (["loss"], ["loss"], "steps"))
    pb = {p: k for k, p in enumerate(b.param_names)}
    params = [(k, pb[p]) for k, p in enumerate(a.param_names) if p in pb]
    back = params[::-1]  # the backward reaches the last parameters first
    add("backward", [(f"gradient norm of {a.param_names[k]}", [a.param_names[k]]) for k, _ in back],
        ([k for k, _ in back], [j for _, j in back], "params/grad_norm"))
    add("update", [("learning rate", [])], (["lr"], ["lr"], "steps"), noiseless=True)
    add("update", [(f"weight norm of {a.param_names[k]}", [a.param_names[k]]) for k, _ in params],
        ([k for k, _ in params], [j for _, j in params], "params/param_norm"))
    return groups


def _rows(idx: np.ndarray):
    """A slice where the rows run on (the common case: the same steps in both), else the rows."""
    if len(idx) and idx[-1] - idx[0] == len(idx) - 1:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _block(rt: RankTrace, group: _Group, which: int, rows: np.ndarray, cache: dict) -> np.ndarray:
    """The group's columns at ``rows`` of one run. Per-step series (loss, lr, the batch's) are
    read whole once (``cache``: a 1-D float column a step), the steps x tensors tables by rows, as
    the file holds them (float32: no copy to float64 of a block of 200 columns)."""
    cols = group.cols_a if which == 0 else group.cols_b
    table = group.table
    if table == "steps":
        for c in cols:
            if (which, c) not in cache:
                cache[which, c] = rt.columns[c].to_numpy(dtype=np.float64)
        return np.stack([cache[which, c][rows] for c in cols], axis=1)
    if not cols:
        return np.zeros((len(rows), 0))
    _, data = rt._read_rows(table, _rows(rows), rt.n_steps)
    return data if cols == list(range(data.shape[1])) else data[:, cols]


def common_steps(a: RankTrace, b: RankTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sa, sb = a.step_index, b.step_index
    if np.array_equal(sa, sb) and (np.diff(sa) > 0).all():  # (the common case, asked ~6 times: no sort)
        rows = np.arange(len(sa))
        return sa, rows, rows
    return np.intersect1d(sa, sb, assume_unique=True, return_indices=True)


def exact_regime(a: RankTrace, b: RankTrace) -> bool:
    """The batch of the first common step is the same to the bit (older traces, which lack the
    batch's statistics: the loss of that step is)."""
    steps, ia, ib = common_steps(a, b)
    if not len(steps):
        return False
    va = np.array([a.columns[c].to_numpy(dtype=np.float64)[ia[0]] for c, _ in _BATCH])
    vb = np.array([b.columns[c].to_numpy(dtype=np.float64)[ib[0]] for c, _ in _BATCH])
    if np.isnan(va).all() and np.isnan(vb).all():
        va = a.columns["loss"].to_numpy(dtype=np.float64)[ia[:1]]
        vb = b.columns["loss"].to_numpy(dtype=np.float64)[ib[:1]]
    return bool(np.isfinite(va).all() and np.array_equal(va, vb))


def _comparable(x: np.ndarray, y: np.ndarray, table: str) -> np.ndarray:
    """Where both runs measured the value (-1 in a per-step table of measured values: not measured)."""
    if table == "steps":
        return np.ones(x.shape, dtype=bool)
    return (x != -1) & (y != -1)


def first_difference(a: RankTrace, b: RankTrace, stages=_STAGES) -> Parting | None:
    """The first value, in step order, that differs at all (NaN equal to NaN)."""
    steps, ia, ib = common_steps(a, b)
    groups = [g for g in _groups(a, b) if g.stage in stages]
    cache: dict = {}
    for s in range(0, len(steps), BLOCK):
        ra, rb = ia[s:s + BLOCK], ib[s:s + BLOCK]
        best = None  # (row, order, series, a, b)
        for g in groups:
            if not g.series:
                continue
            x, y = _block(a, g, 0, ra, cache), _block(b, g, 1, rb, cache)
            if _same_bits(x, y):  # (the common case, and one pass instead of six)
                continue
            differ = _comparable(x, y, g.table) & (x != y) & ~(np.isnan(x) & np.isnan(y))
            hit = np.argwhere(differ)
            if not hit.size:
                continue
            row = int(hit[:, 0].min())
            col = min((int(c) for c in hit[hit[:, 0] == row][:, 1]), key=lambda c: g.series[c].order)
            key = (row, g.series[col].order)
            if best is None or key < best[:2]:
                best = (row, g.series[col].order, g.series[col], float(x[row, col]), float(y[row, col]))
        if best is not None:
            row, _, ser, va, vb = best
            return Parting(int(steps[s + row]), ser.stage, ser.what, ser.where, va, vb, True)
    return None


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    """The two blocks hold the same bits: no value of them differs (NaN equal to NaN)."""
    if x.shape != y.shape or x.dtype != y.dtype or x.dtype.kind not in "fiu":
        return False
    u = np.dtype(f"u{x.dtype.itemsize}")
    return bool(np.array_equal(np.ascontiguousarray(x).view(u), np.ascontiguousarray(y).view(u)))


def statistical_parting(a: RankTrace, b: RankTrace, stages=_STAGES) -> Parting | None:
    """The first step where B leaves A's noise band for a sustained stretch (see the docstring).
    The series of a table are judged together, a block of steps at a time (one 2-D pass)."""
    steps, ia, ib = common_steps(a, b)
    groups = [g for g in _groups(a, b) if g.series and g.stage in stages]
    carries = [_Carry(len(g.series)) for g in groups]
    cache: dict = {}
    best = None  # (step, order, Parting)
    for s in range(0, len(steps), BLOCK):
        if best is not None and steps[s] > best[0]:
            break  # nothing that starts later can be earlier
        ra, rb = ia[s:s + BLOCK], ib[s:s + BLOCK]
        at = steps[s:s + BLOCK]
        for g, carry in zip(groups, carries):
            x, y = _block(a, g, 0, ra, cache), _block(b, g, 1, rb, cache)
            for c, (step, va, vb) in _beyond_band(g, x, y, at, carry):
                ser = g.series[c]
                if best is None or (step, ser.order) < best[:2]:
                    best = (step, ser.order, Parting(step, ser.stage, ser.what, ser.where, va, vb, False))
    return best[2] if best is not None else None


def loss_parting(a: RankTrace, b: RankTrace, exact: bool) -> Parting | None:
    """Where the loss alone parted, in the regime the runs were judged in."""
    return first_difference(a, b, ("loss",)) if exact else statistical_parting(a, b, ("loss",))


NOISE_SAMPLE = 4096  # step-to-step changes a block's noise is estimated from (a median: a sample serves)


def _noise(logs: np.ndarray) -> np.ndarray:
    """Each column's step-to-step noise: the median |change| of its log, as one value's std."""
    if len(logs) < 3:
        return np.zeros(logs.shape[1])
    step = max(1, (len(logs) - 1) // NOISE_SAMPLE)  # (the sampled changes only: np.diff's, every step-th)
    d = np.abs(logs[1::step] - logs[:-1:step])
    return 1.4826 * np.median(d, axis=0) / math.sqrt(2.0)


class _Carry:
    """Per series of a group, across blocks: the stretch beyond the band still open (its length in
    values, and the step and values it began with), and whether the series has parted."""

    def __init__(self, n: int):
        self.run = np.zeros(n, dtype=np.int64)
        self.step = np.zeros(n, dtype=np.int64)
        self.a, self.b = np.zeros(n), np.zeros(n)
        self.done = np.zeros(n, dtype=bool)


def _beyond_band(g: _Group, x: np.ndarray, y: np.ndarray, at: np.ndarray, carry: _Carry) -> list:
    """[(column, (step, A's, B's value))] of the group's series whose stretch of ``sustain``
    values beyond the band completes in this block (``at``: its steps), the stretch's first value
    each; the open stretches carried to the next block. Values that either run did not measure
    (or that are not positive and finite) neither count nor break a stretch."""
    ok = (x > 0) & (x < np.inf) & (y > 0) & (y < np.inf)  # (-1, "not measured", is not > 0)
    ok &= ~carry.done & np.array([not 0 < ser.numel < MIN_NUMEL for ser in g.series])
    measured = ok.any(axis=1)  # (steps whose tensors were not measured: weight norms, watched steps)
    if not measured.all():
        ok, x, y, at = ok[measured], x[measured], y[measured], at[measured]
    if not ok.size or not ok.any():
        return []
    with np.errstate(invalid="ignore", divide="ignore"):  # (a log where not ok is never used)
        la, lb = np.log(x), np.log(y)
    if g.series[0].noiseless:
        beyond = ok & (np.abs(lb - la) > 1e-6)
    else:
        noise = np.zeros(len(g.series))
        full = ok.all(axis=0)
        if full.all():  # (the common case: no copy of the block's logs)
            noise[:] = np.maximum(_noise(la), _noise(lb))
        elif full.any():
            noise[full] = np.maximum(_noise(la[:, full]), _noise(lb[:, full]))
        for c in np.flatnonzero(~full & ok.any(axis=0)):  # (a series measured on fewer steps)
            m = ok[:, c]
            noise[c] = max(_noise(la[m, c:c + 1])[0], _noise(lb[m, c:c + 1])[0])
        band = np.maximum(Z * math.sqrt(2.0) * noise, math.log(MIN_RATIO))
        beyond = ok & (np.abs(lb - la) >= band)
    # Only series with a value beyond the band, or a stretch open from the block before, can
    # complete one (two seeds of one recipe: few or none).
    cols = np.flatnonzero(beyond.any(axis=0) | (carry.run > 0))
    if not cols.size:
        return []
    ok, beyond, n = ok[:, cols], beyond[:, cols], len(at)
    # A stretch can complete only where the values beyond the band (with those carried in) reach
    # `sustain`, and stays open only where the last measured value is beyond it; the others (two
    # seeds: most, a lone value beyond the band) just close what they carried.
    has_ok = ok.any(axis=0)
    open_at_end = ~has_ok | beyond[n - 1 - ok[::-1].argmax(axis=0), np.arange(len(cols))]
    keep = open_at_end | (beyond.sum(axis=0) + carry.run[cols] >= g.series[0].sustain)
    carry.run[cols[~keep]] = 0
    if not keep.all():
        cols, ok, beyond = cols[keep], ok[:, keep], beyond[:, keep]
    if not cols.size:
        return []
    rows = np.arange(n)[:, None]
    counted = np.cumsum(ok, axis=0)  # values measured through each row
    last_in = np.maximum.accumulate(np.where(ok & ~beyond, rows, -1), axis=0)  # the last inside the band
    before = np.take_along_axis(counted, np.maximum(last_in, 0), axis=0)
    run = np.where(last_in < 0, carry.run[cols] + counted, counted - before)
    complete = beyond & (run >= g.series[0].sustain)

    def first_after(row: int, k: int) -> int:  # the first measured row after `row`: where a stretch begins
        return row + 1 + int(ok[row + 1:, k].argmax())

    found = []
    for k, c in enumerate(cols):
        if complete[:, k].any():
            li = int(last_in[complete[:, k].argmax(), k])
            if li < 0 and carry.run[c]:  # the stretch began in an earlier block
                found.append((int(c), (int(carry.step[c]), float(carry.a[c]), float(carry.b[c]))))
            else:
                j = first_after(li, k)
                found.append((int(c), (int(at[j]), float(x[j, c]), float(y[j, c]))))
            carry.done[c], carry.run[c] = True, 0
            continue
        # What stays open: the stretch after the block's last value inside the band.
        li, tail = int(last_in[-1, k]), int(run[-1, k])
        if tail and (li >= 0 or not carry.run[c]):
            j = first_after(li, k)
            carry.step[c], carry.a[c], carry.b[c] = int(at[j]), float(x[j, c]), float(y[j, c])
        carry.run[c] = tail
    return found
