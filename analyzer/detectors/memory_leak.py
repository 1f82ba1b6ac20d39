"""memory_leak: memory grows steadily with steps instead of reaching a plateau.

Data: per step, the process's resident memory and, on a GPU, the CUDA allocator's allocated and
reserved bytes; every so often a census of live tensors (count, bytes, how many hold an
autograd graph). Heuristic, per series (CUDA allocated, else host RSS), after a warm-up of
`warmup_frac` of the run:

- the growth (median of the last 5 steps minus median of the first 5) must reach
  `min_growth_bytes` and `min_growth_share` of the starting level;
- a one-off jump (one step holding `jump_share` of the growth) is not a leak;
- a plateau (the last third growing at under `min_tail_slope_share` of the overall slope) is
  warm-up or a cache filling up, not a leak; on CUDA, reserved memory growing while allocated
  memory stays flat is the caching allocator, not a leak;
- a straight line must explain the growth (R^2 >= `min_r2`).

The leak is estimated as the fitted slope (bytes per step), dated at the first step from which
memory stays above its level at the end of the warm-up (a leak already growing then is dated
back as far as the fitted line explains the memory), within the span the tensor census
brackets (memory flat past a census that saw the kept tensors grown: dated where the census's
count, run back at its rate, starts). The tensor census, when it grows too, points at the cause
(_leak_causes.py: the census, its fastest-growing group of tensors, the CUDA allocator
snapshots' sites).

A kept loss whose graph backward() already freed costs only KBs a step: memory hides it for
thousands of steps. So when memory shows no leak, a census count of tensors holding an autograd
graph that grows along a straight line (`graph_min_per_step`, `graph_min_growth`,
`graph_min_censuses`, two at least: the census keeps to its time budget) is reported as one too
("+1 scalar tensor with a graph per step"). How little a leak can be and still be found: in
memory, `min_growth_bytes` (16 MiB) and `min_growth_share` (5%) of the process over the run
after its warm-up; by the census, any tensor holding a graph, kept at `graph_min_per_step`
(one every other step) and `graph_min_growth` (50) in all between two censuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..findings import Evidence as FindingEvidence
from ..findings import Finding
from ..trace import RankTrace
from ._leak_causes import ADVICE_GRAPH, census_cause, growing_group, growing_site


@dataclass(frozen=True)
class MemoryLeakConfig:
    # Warm-up excluded from the fit: allocator pools, lazy initialisation and the first
    # optimizer state make memory climb early in every run.
    warmup_frac: float = 0.2
    min_steps: int = 30
    # Growth over the analysed span that counts: at least this many bytes and this share of the
    # memory at its start. (glibc and the CUDA caching allocator move RSS/reserved by a few MB
    # on healthy runs; measured on the sample traces.)
    min_growth_bytes: float = 16 * 2**20
    min_growth_share: float = 0.05
    # Steady: a straight line explains the growth (R^2) and the last third still grows at this
    # share of the overall slope (a plateau does not).
    min_r2: float = 0.8
    min_tail_slope_share: float = 0.5
    # One-off jump: a single step holds this share of the whole growth.
    jump_share: float = 0.5
    # Tensors holding an autograd graph, counted by the census: a leak even before memory shows
    # it when they grow by at least this many per step, this many in all, over this many
    # censuses (healthy sample runs hold exactly 1, the step's loss, at every census; a kept
    # loss adds 1 per step).
    graph_min_per_step: float = 0.5
    graph_min_growth: int = 50
    # Two censuses are enough: a count of graph-holding tensors that rose by graph_min_growth
    # between them is no noise (healthy runs hold the same few at every census), and the census
    # keeps within its time budget, so a run of 100 steps of 20 ms has two (a forward hook
    # keeping a ResNet stage's output for 80 steps: 2 -> 52 while resident memory hid it).
    # With 3 or more, a straight line must explain them (min_r2).
    graph_min_censuses: int = 2


class Evidence(FindingEvidence, total=False):
    series: str  # what grew: "cuda_allocated_bytes" or "rss_bytes" (memory), "live_tensors_with_graph" (census)
    bytes_per_step: float  # memory: the fitted line's slope (bytes per step)
    growth_bytes: float  # ... growth over the analysed steps (bytes)
    from_bytes: float  # ... memory at their start (median of the first 5, bytes)
    to_bytes: float  # ... and at their end (median of the last 5, bytes)
    steps_analysed: list  # ... [first, last] step after the warm-up
    r2: float  # R^2 of the straight line through memory, or through the census's graph count
    tail_slope_share: float  # memory: the last third's slope over the whole span's
    census_steps: int | list  # memory: how many censuses ran; census count: [first, last] census step
    live_tensors: list  # memory: live tensors at the first and the last census
    live_tensors_per_step: float  # ... their fitted growth per step
    live_tensors_with_graph_per_step: float  # ... of those holding an autograd graph, per step
    live_tensor_bytes_per_step: float  # ... of their bytes (bytes per step)
    growing_sites: list  # CUDA: allocation sites that grew most between two allocator snapshots
    #                      ({site, bytes_before, bytes_after, blocks_before, blocks_after, stack, steps})
    growing_group: dict  # the census group that grew fastest ({device, dtype, shape, graph, grad_fn,
    #                      growing_since_step, grown_by_step, started_about_step, tensors_per_step,
    #                      bytes_per_step, census_steps, modules})
    tensors_with_graph_per_step: float  # census count: tensors holding a graph, fitted growth per step
    tensors_with_graph: list  # ... their count at the first and the last census
    censuses: int  # ... how many censuses counted them
    rss_bytes_per_step: float  # ... resident memory's fitted growth meanwhile (bytes per step; NaN: unmeasured)


KIND = "memory_leak"
REQUIRES = ("steps/rss_bytes",)
CONFIG = MemoryLeakConfig  # its thresholds: a [memory_leak] table of analyze --config
ORDER = 60  # among findings of one step and stage, the detectors run (and list) in this order


def detect(rt: RankTrace, cfg: MemoryLeakConfig) -> list[Finding]:
    steps_df = rt.columns
    if len(steps_df) < cfg.min_steps:
        return []
    steps = steps_df.index.to_numpy()
    findings = []
    alloc = steps_df["cuda_allocated_bytes"].to_numpy(dtype=float)
    series = []
    if (alloc >= 0).all():
        series.append(("cuda_allocated_bytes", "GPU memory allocated by tensors", alloc))
    series.append(("rss_bytes", "resident memory of the process", steps_df["rss_bytes"].to_numpy(dtype=float)))
    for column, label, y in series:
        f = _leak(rt, steps, y, column, label, cfg)
        if f is not None:
            findings.append(f)
            break  # a device leak shows in RSS too (pinned buffers); report the most direct one
    if not findings:
        f = _graphs_kept(rt, steps, steps_df["rss_bytes"].to_numpy(dtype=float), cfg)
        if f is not None:
            findings.append(f)
    return findings


def _graphs_kept(rt, steps, rss, cfg) -> Finding | None:
    """Tensors holding an autograd graph pile up step after step, while memory barely grows yet.

    A loss kept in a list after backward() holds its graph's nodes but not the activations
    (backward freed them): a few KB a step, lost in the noise of resident memory for thousands
    of steps, then gigabytes in a long job. The census counts them: a count that grows along a
    straight line by `graph_min_per_step` or more, `graph_min_growth` tensors in all over
    `graph_min_censuses` censuses, is a leak (healthy runs hold a constant few: the current loss).
    """
    evidence = _graph_count_growth(rt, steps, rss, cfg)
    if evidence is None:
        return None
    group = growing_group(rt)
    where: list[str] = []
    begin = evidence["census_steps"][0]
    if group is not None and group["graph"]:
        cause, where = group["cause"], group["modules"]
        evidence["growing_group"] = {k: v for k, v in group.items() if k not in ("cause", "advice")}
        begin = group["growing_since_step"]  # the last census before the kept group grew
    else:
        cause = "A tensor with its graph is kept across iterations."
    (n0, n1), (s0, s1) = evidence["tensors_with_graph"], evidence["census_steps"]
    rss_slope = evidence["rss_bytes_per_step"]
    grows = (f"resident memory grows only {rss_slope / 1024:.1f} KiB per step so far"
             if np.isfinite(rss_slope) else "memory was not measured")
    fit = f", census R^2 {evidence['r2']:.2f}" if evidence["censuses"] > 2 else ", two censuses"
    summary = (f"Memory leak: tensors holding an autograd graph pile up by "
               f"{evidence['tensors_with_graph_per_step']:.1f} per step ({n0} at step {s0}, {n1} at step {s1}"
               f"{fit}); "
               f"{grows}, but each kept graph stays until the job ends. {cause}")
    return Finding(KIND, "warning", begin, where, summary, evidence, ADVICE_GRAPH)


def _graph_count_growth(rt, steps, rss, cfg) -> dict | None:
    """The evidence of a census count of tensors holding a graph that grows along a straight line."""
    g = rt.columns["live_tensors_with_graph"].to_numpy(dtype=float)
    sel = g >= 0
    if sel.sum() < cfg.graph_min_censuses:
        return None
    xs, ys = steps[sel].astype(float), g[sel]
    if float(ys[-1] - ys[0]) < cfg.graph_min_growth:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    fit = slope * xs + intercept
    ss_tot = float(((ys - ys.mean()) ** 2).sum())
    r2 = 1.0 - float(((ys - fit) ** 2).sum()) / ss_tot if ss_tot > 0 else 0.0
    if slope < cfg.graph_min_per_step or r2 < cfg.min_r2:
        return None
    ok = np.isfinite(rss) & (rss >= 0)
    rss_slope = float(np.polyfit(steps[ok].astype(float), rss[ok], 1)[0]) if ok.sum() >= 2 else float("nan")
    return {
        "series": "live_tensors_with_graph",
        "tensors_with_graph_per_step": float(slope),
        "tensors_with_graph": [int(ys[0]), int(ys[-1])],
        "census_steps": [int(xs[0]), int(xs[-1])],
        "censuses": int(sel.sum()),
        "r2": float(r2),
        "rss_bytes_per_step": rss_slope,
    }


@dataclass(frozen=True)
class _Growth:
    """A memory series after the warm-up that grows steadily, and the straight line through it."""

    start: int  # the first row after the warm-up
    x: np.ndarray  # the steps after it where memory was measured
    base: float  # memory at the start of that span: median of its first 5 steps (bytes)
    end: float  # ... at its end: median of its last 5 (bytes)
    slope: float  # the fitted line (bytes per step)
    intercept: float
    resid: np.ndarray  # memory less the line, per step of x (bytes)
    r2: float  # how much of the variance the line explains
    tail_slope: float  # the slope of the last third of the span (bytes per step)

    @property
    def growth(self) -> float:
        return self.end - self.base


def _steady_growth(steps, y, cfg) -> _Growth | None:
    """The growth of y after the warm-up, if it is large, not one jump, straight and not levelling off."""
    start = max(int(len(y) * cfg.warmup_frac), 5)
    x, v = steps[start:].astype(float), y[start:]
    ok = np.isfinite(v) & (v >= 0)
    x, v = x[ok], v[ok]
    if len(v) < cfg.min_steps:
        return None
    base, end = float(np.median(v[:5])), float(np.median(v[-5:]))
    growth = end - base
    if growth < max(cfg.min_growth_bytes, cfg.min_growth_share * base):
        return None
    if np.diff(v).max() >= cfg.jump_share * growth:
        return None  # one allocation, not a leak
    slope, intercept = np.polyfit(x, v, 1)
    fit = slope * x + intercept
    ss_res, ss_tot = float(((v - fit) ** 2).sum()), float(((v - v.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    # A last third growing slower than the whole is a cache filling up: a plateau ahead.
    tail = len(v) * 2 // 3
    tail_slope = np.polyfit(x[tail:], v[tail:], 1)[0] if len(v) - tail >= 3 else 0.0
    if r2 < cfg.min_r2 or tail_slope < cfg.min_tail_slope_share * slope or slope <= 0:
        return None
    return _Growth(start, x, base, end, slope, intercept, v - fit, r2, tail_slope)


def _leak(rt, steps, y, column, label, cfg) -> Finding | None:
    m = _steady_growth(steps, y, cfg)
    if m is None:
        return None
    begin = _rise(steps, y, m.start, m.growth, m.slope)
    rose = begin is not None  # memory shows a flat stretch, then the rise
    if not rose:  # growing from the end of the warm-up on: it may have begun before
        begin = _onset(steps.astype(float), y, m.start, m.slope, m.intercept, m.resid, m.growth)
    evidence = {
        "series": column,
        "bytes_per_step": float(m.slope),
        "growth_bytes": float(m.growth),
        "from_bytes": m.base,
        "to_bytes": m.end,
        "steps_analysed": [int(m.x[0]), int(m.x[-1])],
        "r2": float(m.r2),
        "tail_slope_share": float(m.tail_slope / m.slope),
    }
    cause, advice = census_cause(rt, steps, evidence)
    where: list[str] = []
    group = growing_group(rt)
    if group is not None:
        cause, advice, where = group["cause"], group["advice"], group["modules"]
        # The census brackets the start: after the last census at the group's smallest count,
        # by the next census. A rise memory shows is dated within that span; a leak growing since
        # before the warm-up's end (memory's own start is blurred by the warm-up) from that census.
        lo, hi = group["growing_since_step"], group["grown_by_step"]
        begin = int(min(max(begin, lo), hi)) if rose else min(begin, lo)
        if rose and begin == hi > lo:
            # Memory stood flat past the census that saw the group already grown (an allocator
            # reusing freed pages hides a leak's first MiBs): the census's count dates it.
            begin = group["started_about_step"]
        evidence["growing_group"] = {k: v for k, v in group.items() if k not in ("cause", "advice")}
    if column == "cuda_allocated_bytes":
        cause += growing_site(rt, int(m.x[0]), evidence)
    mb = m.slope / 2**20
    per = f"{mb:.2f} MiB" if abs(mb) >= 0.01 else f"{m.slope / 1024:.1f} KiB"
    summary = (f"Memory leak: the {label} grows steadily by {per} per step, "
               f"{m.base / 2**20:.0f} -> {m.end / 2**20:.0f} MiB over steps {int(m.x[0])}-{int(m.x[-1])} "
               f"(straight-line fit R^2 {m.r2:.2f}), since about step {begin}. {cause}")
    return Finding(KIND, "warning", begin, where, summary.strip(), evidence, advice)


def _rise(x: np.ndarray, y: np.ndarray, start: int, growth: float, slope: float) -> int | None:
    """The first step from which memory stays (10 steps running) above its level at the end of
    the warm-up: the median of the 20 steps before `start`, plus 3 sigma of them or 5% of the
    growth (allocators move RSS by a few MiB on their own). None if memory was not flat over
    those 20 steps (it moved by half of what the leak adds in 20 steps: a leak growing from
    earlier, in an allocator's bursts) or was already above at the end of the warm-up."""
    before = y[max(0, start - 20):start]
    before = before[np.isfinite(before) & (before >= 0)]
    if len(before) < 3 or np.ptp(before) >= 0.5 * 20 * slope:
        return None
    above = y > float(np.median(before)) + max(3.0 * float(np.std(before)), 0.05 * growth)
    for j in np.flatnonzero(above[start:]) + start:
        if above[j:j + 10].all():
            return int(x[j]) if j > start else None
    return None


def _onset(x_all, y_all, start, slope, intercept, resid, growth) -> int:
    """The step the leak began: walking back from the end of the warm-up, the earliest step
    from which the fitted line still explains the memory (a leak from the first step is dated
    there; warm-up growth or a flat stretch before the leak stops the walk)."""
    tol = max(3.0 * float(np.std(resid)), 0.02 * growth)
    begin = start
    for t in range(start - 1, -1, -1):
        if not np.isfinite(y_all[t]) or abs(y_all[t] - (slope * x_all[t] + intercept)) > tol:
            break
        begin = t
    return int(x_all[begin])
