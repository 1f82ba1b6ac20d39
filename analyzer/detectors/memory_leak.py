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
brackets. The tensor census, when it grows too, points at the cause.

A kept loss whose graph backward() already freed costs only KBs a step: memory hides it for
thousands of steps. So when memory shows no leak, a census count of tensors holding an autograd
graph that grows along a straight line (`graph_min_per_step`, `graph_min_growth`,
`graph_min_censuses`) is reported as one too ("+1 scalar tensor with a graph per step").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..findings import Finding
from ..memory_snapshot import site_growth
from ..trace import RankTrace


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
    graph_min_censuses: int = 4


KIND = "memory_leak"
REQUIRES = ("steps/rss_bytes",)
CONFIG = MemoryLeakConfig  # its thresholds: a [memory_leak] table of analyze --config
ORDER = 60  # among findings of one step and stage, the detectors run (and list) in this order

_ADVICE_GRAPH = (
    "A tensor that holds an autograd graph is kept from step to step — typically "
    "`losses.append(loss)` or `total += loss`: keep `loss.item()` (or `loss.detach()`) instead, "
    "so each step's graph and its saved activations can be freed."
)
_ADVICE_TENSORS = (
    "Tensors accumulate across steps: look for lists, dicts or caches that grow each step (hooks "
    "that store outputs, metrics kept as tensors, torch.cat into a buffer) and keep only what you "
    "need, detached and on the CPU."
)
_ADVICE_OTHER = (
    "Memory grows outside the tensors visible to Python: autograd graphs kept alive by a "
    "reference (retain_graph=True, a stored loss), Python objects accumulated per step (lists of "
    "metrics, logging buffers), or a data loader that caches samples. Compare memory snapshots "
    "a few hundred steps apart (tracemalloc, torch.cuda.memory._snapshot())."
)


def detect(rt: RankTrace, cfg: MemoryLeakConfig) -> list[Finding]:
    steps_df = rt.steps
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
    g = rt.steps["live_tensors_with_graph"].to_numpy(dtype=float)
    sel = g >= 0
    if sel.sum() < cfg.graph_min_censuses:
        return None
    xs, ys = steps[sel].astype(float), g[sel]
    growth = float(ys[-1] - ys[0])
    if growth < cfg.graph_min_growth:
        return None
    slope, intercept = np.polyfit(xs, ys, 1)
    fit = slope * xs + intercept
    ss_tot = float(((ys - ys.mean()) ** 2).sum())
    r2 = 1.0 - float(((ys - fit) ** 2).sum()) / ss_tot if ss_tot > 0 else 0.0
    if slope < cfg.graph_min_per_step or r2 < cfg.min_r2:
        return None
    ok = np.isfinite(rss) & (rss >= 0)
    rss_slope = float(np.polyfit(steps[ok].astype(float), rss[ok], 1)[0]) if ok.sum() >= 2 else float("nan")
    evidence = {
        "series": "live_tensors_with_graph",
        "tensors_with_graph_per_step": float(slope),
        "tensors_with_graph": [int(ys[0]), int(ys[-1])],
        "census_steps": [int(xs[0]), int(xs[-1])],
        "censuses": int(sel.sum()),
        "r2": float(r2),
        "rss_bytes_per_step": rss_slope,
    }
    group = _growing_group(rt)
    where: list[str] = []
    begin = int(xs[0])
    if group is not None and group["graph"]:
        cause, where = group["cause"], group["modules"]
        evidence["growing_group"] = {k: v for k, v in group.items() if k not in ("cause", "advice")}
        begin = group["growing_since_step"]  # the last census before the kept group grew
    else:
        cause = "A tensor with its graph is kept across iterations."
    grows = (f"resident memory grows only {rss_slope / 1024:.1f} KiB per step so far"
             if np.isfinite(rss_slope) else "memory was not measured")
    summary = (f"Memory leak: tensors holding an autograd graph pile up by {slope:.1f} per step "
               f"({int(ys[0])} at step {int(xs[0])}, {int(ys[-1])} at step {int(xs[-1])}, census R^2 {r2:.2f}); "
               f"{grows}, but each kept graph stays until the job ends. {cause}")
    return Finding(KIND, "warning", begin, where, summary, evidence, _ADVICE_GRAPH)


def _leak(rt, steps, y, column, label, cfg) -> Finding | None:
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
    jumps = np.diff(v)
    if jumps.max() >= cfg.jump_share * growth:
        return None
    slope, intercept = np.polyfit(x, v, 1)
    fit = slope * x + intercept
    ss_res, ss_tot = float(((v - fit) ** 2).sum()), float(((v - v.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
    tail = len(v) * 2 // 3
    tail_slope = np.polyfit(x[tail:], v[tail:], 1)[0] if len(v) - tail >= 3 else 0.0
    if r2 < cfg.min_r2 or tail_slope < cfg.min_tail_slope_share * slope or slope <= 0:
        return None
    begin = _rise(steps, y, start, growth, slope)
    rose = begin is not None  # memory shows a flat stretch, then the rise
    if not rose:  # growing from the end of the warm-up on: it may have begun before
        begin = _onset(steps.astype(float), y, start, slope, intercept, v - fit, growth)
    evidence = {
        "series": column,
        "bytes_per_step": float(slope),
        "growth_bytes": float(growth),
        "from_bytes": base,
        "to_bytes": end,
        "steps_analysed": [int(x[0]), int(x[-1])],
        "r2": float(r2),
        "tail_slope_share": float(tail_slope / slope),
    }
    cause, advice = _census(rt, steps, evidence)
    where: list[str] = []
    group = _growing_group(rt)
    if group is not None:
        cause, advice, where = group["cause"], group["advice"], group["modules"]
        # The census brackets the start: after the last census at the group's smallest count,
        # by the next census. A rise memory shows is dated within that span; a leak growing since
        # before the warm-up's end (memory's own start is blurred by the warm-up) from that census.
        lo, hi = group["growing_since_step"], group["grown_by_step"]
        begin = int(min(max(begin, lo), hi)) if rose else min(begin, lo)
        evidence["growing_group"] = {k: v for k, v in group.items() if k not in ("cause", "advice")}
    if column == "cuda_allocated_bytes":
        cause += _growing_site(rt, int(x[0]), evidence)
    mb = slope / 2**20
    per = f"{mb:.2f} MiB" if abs(mb) >= 0.01 else f"{slope / 1024:.1f} KiB"
    summary = (f"Memory leak: the {label} grows steadily by {per} per step, "
               f"{base / 2**20:.0f} -> {end / 2**20:.0f} MiB over steps {int(x[0])}-{int(x[-1])} "
               f"(straight-line fit R^2 {r2:.2f}), since about step {begin}. {cause}")
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


def _growing_group(rt) -> dict | None:
    """The census group (device, dtype, shape, graph, the graph's last op) that grew most between
    the first and the last census, if it gained at least one tensor every two steps; with the
    modules whose output has that shape and dtype, and was made by that op when both are known
    (the likely makers of the kept tensors)."""
    g = rt.census_groups
    if g.empty or g["step"].nunique() < 2:
        return None
    first, last = int(g["step"].min()), int(g["step"].max())
    key = ["device", "dtype", "shape", "graph", "grad_fn"]
    a = g[g["step"] == first].set_index(key)[["count", "bytes"]]
    b = g[g["step"] == last].set_index(key)[["count", "bytes"]]
    grow = b.sub(a, fill_value=0).fillna(0)
    grow = grow[grow["count"] > 0]
    if grow.empty:
        return None
    per_step = grow / max(last - first, 1)
    # Of the groups that gained a tensor every two steps or more, the one that grew most in
    # bytes (a group that merely entered the census's top lists gains a few, once).
    per_step = per_step[per_step["count"] >= 0.5]
    if per_step.empty:
        return None
    top = per_step.sort_values(["bytes", "count"], ascending=False)
    # Kept losses (scalars holding their graph) keep everything their graphs saved, which grows
    # as well and weighs more: they are the cause, the rest what they hold.
    losses = [k for k in top.index if k[2] == "[]" and k[3]]
    if losses:
        top = top.loc[losses]
    (device, dtype, shape, graph, grad_fn), row = top.index[0], top.iloc[0]
    holding = " holding an autograd graph" if graph else ""
    what = "scalar" if shape == "[]" else f"{shape}"
    makers = rt.module_outputs
    makers = makers[(makers["shape"] == shape) & (makers["dtype"] == dtype)]
    if grad_fn and (makers["grad_fn"] == grad_fn).any():
        makers = makers[makers["grad_fn"] == grad_fn]
    # A module that returns its submodule's output as its own is not another maker: keep the
    # innermost (a parent is a prefix of its submodules' names).
    names = list(dict.fromkeys(makers["module"]))
    names = [m for m in names if not any(o != m and o.startswith(m + "." if m else "") for o in names)]
    modules = names if 0 < len(names) <= 3 else []
    made = f" made by {grad_fn}" if grad_fn else ""
    cause = (f"The tensor census grows by {row['count']:.1f} {what} {dtype} tensor(s){made} on {device}{holding} per "
             f"step ({int(a['count'].get((device, dtype, shape, graph, grad_fn), 0))} at step {first}, "
             f"{int(b['count'].loc[(device, dtype, shape, graph, grad_fn)])} at step {last})")
    if graph and shape == "[]":
        cause += ": a loss tensor kept across iterations."
        advice = _ADVICE_GRAPH
    elif graph:
        cause += ": tensors kept with their autograd graph."
        advice = _ADVICE_GRAPH
    else:
        cause += "."
        advice = _ADVICE_TENSORS
    if modules:
        cause += f" That is the shape of the output of {', '.join(modules)}: something keeps it (a hook, a cache)."
    # The census dates the start better than memory does (allocators grow in bursts): the
    # last census at which the group was at its smallest.
    mine = g[(g[key] == pd.Series(top.index[0], index=key)).all(axis=1)]
    counts = mine.set_index("step")["count"].reindex(sorted(g["step"].unique()), fill_value=0)
    k = int(np.flatnonzero(counts.to_numpy() == counts.min())[-1])
    since, by = int(counts.index[k]), int(counts.index[min(k + 1, len(counts) - 1)])
    return {"device": device, "dtype": dtype, "shape": shape, "graph": bool(graph), "grad_fn": grad_fn,
            "growing_since_step": since, "grown_by_step": by,
            "tensors_per_step": float(row["count"]), "bytes_per_step": float(row["bytes"]),
            "census_steps": [first, last], "modules": modules, "cause": cause, "advice": advice}


def _census(rt, steps, evidence) -> tuple[str, str]:
    """What the live-tensor census says about the cause, and the matching advice."""
    df = rt.steps
    n = df["live_tensors"].to_numpy(dtype=float)
    g = df["live_tensors_with_graph"].to_numpy(dtype=float)
    b = df["live_tensor_bytes"].to_numpy(dtype=float)
    # Every census counts (also in the warm-up): the census is sparse, and what a leak adds per
    # step shows from the first step on.
    sel = n >= 0
    if sel.sum() < 2:
        return ("No tensor census covers the growth (it runs every census_every steps).", _ADVICE_OTHER)
    xs = steps[sel].astype(float)
    # (a least-squares slope of a constant series is ~1e-18, not 0: round that noise away)
    n_slope, g_slope, b_slope = (round(float(np.polyfit(xs, a[sel], 1)[0]), 6) for a in (n, g, b))
    evidence.update({
        "census_steps": int(sel.sum()),
        "live_tensors": [int(n[sel][0]), int(n[sel][-1])],
        "live_tensors_per_step": n_slope,
        "live_tensors_with_graph_per_step": g_slope,
        "live_tensor_bytes_per_step": b_slope,
    })
    if g_slope >= 0.5:
        return (f"Live tensors holding an autograd graph grow by {g_slope:.1f} per step "
                f"({int(g[sel][0])} -> {int(g[sel][-1])}): a tensor with its graph is kept across "
                f"iterations.", _ADVICE_GRAPH)
    if n_slope >= 0.5 or b_slope >= 0.5 * evidence["bytes_per_step"]:
        return (f"Live tensors grow by {n_slope:.1f} per step ({b_slope / 1024:.1f} KiB per step): "
                f"tensors accumulate across iterations.", _ADVICE_TENSORS)
    return ("The live tensors visible to Python do not grow.", _ADVICE_OTHER)


def _growing_site(rt, start: int, evidence: dict) -> str:
    """On CUDA, the allocation site whose live memory grew most between the first and the last
    allocator snapshot of the analysed steps (snapshots taken when memory ran out left out)."""
    snaps = rt.memory_snapshots
    if not len(snaps):
        return ""
    snaps = snaps[~snaps["reason"].isin(["oom", "exception"])]
    later = snaps[snaps["step"] >= start]
    snaps = later if len(later) >= 2 else snaps
    if len(snaps) < 2:
        return ""
    a, b = snaps.iloc[0], snaps.iloc[-1]
    grew = site_growth(rt, int(a["snapshot"]), int(b["snapshot"]))
    if not grew:
        return ""
    evidence["growing_sites"] = [{**g, "steps": [int(a["step"]), int(b["step"])]} for g in grew]
    g = grew[0]
    return (f" In the CUDA allocator's snapshots, the allocation site whose live memory grew most is "
            f"{g['site']}: {g['bytes_before'] / 2**20:,.1f} -> {g['bytes_after'] / 2**20:,.1f} MiB "
            f"({g['blocks_before']} -> {g['blocks_after']} blocks) from step {int(a['step'])} to step {int(b['step'])}.")
