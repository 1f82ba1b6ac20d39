"""What holds a leak's memory (memory_leak's helper): the live-tensor census (its totals, and the
group of tensors that grew fastest, with the modules that make tensors of that shape) and, on
CUDA, the allocator snapshots' allocation sites. Each says the cause in words and the advice
that goes with it; the numbers it read go into the finding's evidence."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..memory_snapshot import site_growth

ADVICE_GRAPH = (
    "A tensor that holds an autograd graph is kept from step to step — typically "
    "`losses.append(loss)` or `total += loss`: keep `loss.item()` (or `loss.detach()`) instead, "
    "so each step's graph and its saved activations can be freed."
)
ADVICE_TENSORS = (
    "Tensors accumulate across steps: look for lists, dicts or caches that grow each step (hooks "
    "that store outputs, metrics kept as tensors, torch.cat into a buffer) and keep only what you "
    "need, detached and on the CPU."
)
ADVICE_OTHER = (
    "Memory grows outside the tensors visible to Python: autograd graphs kept alive by a "
    "reference (retain_graph=True, a stored loss), Python objects accumulated per step (lists of "
    "metrics, logging buffers), or a data loader that caches samples. Compare memory snapshots "
    "a few hundred steps apart (tracemalloc, torch.cuda.memory._snapshot())."
)


_GROUP_KEY = ["device", "dtype", "shape", "graph", "grad_fn"]  # a census group's columns


@dataclass(frozen=True)
class _Group:
    """A census group (one _GROUP_KEY) and how it grew from the first census to the last."""

    key: tuple  # its _GROUP_KEY values
    first: int  # the first census's step
    last: int  # the last census's step
    count_first: int  # its tensors at the first census
    count_last: int  # ... at the last
    tensors_per_step: float
    bytes_per_step: float


def growing_group(rt) -> dict | None:
    """The census group (device, dtype, shape, graph, the graph's last op) that grew most between
    the first and the last census, if it gained at least one tensor every two steps; with the
    modules whose output has that shape and dtype, and was made by that op when both are known
    (the likely makers of the kept tensors)."""
    g = rt.census_groups
    if g.empty or g["step"].nunique() < 2:
        return None
    grp = _fastest_group(g)
    if grp is None:
        return None
    device, dtype, shape, graph, grad_fn = grp.key
    modules = _makers(rt, shape, dtype, grad_fn)
    # The census dates the start better than memory does (allocators grow in bursts): the
    # last census at which the group was at its smallest, and the census after it.
    mine = g[(g[_GROUP_KEY] == pd.Series(grp.key, index=_GROUP_KEY)).all(axis=1)]
    counts = mine.set_index("step")["count"].reindex(sorted(g["step"].unique()), fill_value=0)
    k = int(np.flatnonzero(counts.to_numpy() == counts.min())[-1])
    k1 = min(k + 1, len(counts) - 1)
    since, by = int(counts.index[k]), int(counts.index[k1])
    # Where the group's growth rate, run back from the census after its smallest count, meets
    # that count: the start, when the kept tensors pile up at a steady rate.
    gained = float(counts.iloc[k1] - counts.iloc[k])
    started = int(round(min(max(by - gained / grp.tensors_per_step, since), by)))
    cause, advice = _group_cause(grp, modules)
    return {"device": device, "dtype": dtype, "shape": shape, "graph": bool(graph), "grad_fn": grad_fn,
            "growing_since_step": since, "grown_by_step": by, "started_about_step": started,
            "tensors_per_step": grp.tensors_per_step, "bytes_per_step": grp.bytes_per_step,
            "census_steps": [grp.first, grp.last], "modules": modules, "cause": cause, "advice": advice}


def _fastest_group(g) -> _Group | None:
    first, last = int(g["step"].min()), int(g["step"].max())
    a = g[g["step"] == first].set_index(_GROUP_KEY)[["count", "bytes"]]
    b = g[g["step"] == last].set_index(_GROUP_KEY)[["count", "bytes"]]
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
    key, row = top.index[0], top.iloc[0]
    return _Group(key, first, last, int(a["count"].get(key, 0)), int(b["count"].loc[key]),
                  float(row["count"]), float(row["bytes"]))


def _makers(rt, shape: str, dtype: str, grad_fn: str) -> list[str]:
    """The modules whose output has this shape and dtype (and grad_fn, when one matches), if 1-3."""
    makers = rt.module_outputs
    makers = makers[(makers["shape"] == shape) & (makers["dtype"] == dtype)]
    if grad_fn and (makers["grad_fn"] == grad_fn).any():
        makers = makers[makers["grad_fn"] == grad_fn]
    # A module that returns its submodule's output as its own is not another maker: keep the
    # innermost (a parent is a prefix of its submodules' names).
    names = list(dict.fromkeys(makers["module"]))
    names = [m for m in names if not any(o != m and o.startswith(m + "." if m else "") for o in names)]
    return names if 0 < len(names) <= 3 else []


def _group_cause(grp: _Group, modules: list[str]) -> tuple[str, str]:
    """What the growing group says about the cause, and the matching advice."""
    device, dtype, shape, graph, grad_fn = grp.key
    holding = " holding an autograd graph" if graph else ""
    what = "scalar" if shape == "[]" else f"{shape}"
    made = f" made by {grad_fn}" if grad_fn else ""
    cause = (f"The tensor census grows by {grp.tensors_per_step:.1f} {what} {dtype} tensor(s){made} on {device}"
             f"{holding} per step ({grp.count_first} at step {grp.first}, {grp.count_last} at step {grp.last})")
    if graph and shape == "[]":
        cause += ": a loss tensor kept across iterations."
        advice = ADVICE_GRAPH
    elif graph:
        cause += ": tensors kept with their autograd graph."
        advice = ADVICE_GRAPH
    else:
        cause += "."
        advice = ADVICE_TENSORS
    if modules and not (graph and shape == "[]"):  # (a kept loss is the loss: no module's output to blame)
        named = ", ".join(m or "the model itself" for m in modules)
        cause += f" That is the shape of the output of {named}: something keeps it (a hook, a cache)."
    return cause, advice


def census_cause(rt, steps, evidence) -> tuple[str, str]:
    """What the live-tensor census says about the cause, and the matching advice."""
    df = rt.columns
    n = df["live_tensors"].to_numpy(dtype=float)
    g = df["live_tensors_with_graph"].to_numpy(dtype=float)
    b = df["live_tensor_bytes"].to_numpy(dtype=float)
    # Every census counts (also in the warm-up): the census is sparse, and what a leak adds per
    # step shows from the first step on.
    sel = n >= 0
    if sel.sum() < 2:
        return ("No tensor census covers the growth (it runs every census_every steps).", ADVICE_OTHER)
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
                f"iterations.", ADVICE_GRAPH)
    if n_slope >= 0.5 or b_slope >= 0.5 * evidence["bytes_per_step"]:
        return (f"Live tensors grow by {n_slope:.1f} per step ({b_slope / 1024:.1f} KiB per step): "
                f"tensors accumulate across iterations.", ADVICE_TENSORS)
    return ("The live tensors visible to Python do not grow.", ADVICE_OTHER)


def growing_site(rt, start: int, evidence: dict) -> str:
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
