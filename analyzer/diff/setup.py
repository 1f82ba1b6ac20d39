"""What differs in the setup of two runs, read from their traces: each difference a row
{"name", "a", "b"}, only what differs, nothing guessed (a value one trace lacks is not compared).
"""

from __future__ import annotations

import numpy as np

from ..trace import RankTrace

# Root attributes compared as they are: the environment and the job.
_META = (("model_class", "model class"), ("n_parameters", "parameters"), ("world_size", "world size"),
         ("torch_version", "torch"), ("python_version", "python"), ("device", "device"), ("host", "host"),
         ("command", "command line"))
NAMES_SHOWN = 8  # modules or parameters listed by name in one row; the rest counted
_LEVEL_STEPS = 20  # the batch statistics' level: their median over the first steps both hold
_LEVEL_RATIO = 1.5  # ... differing this many times (a level, not noise: a change of units, a scaler)


def setup_differences(a: RankTrace, b: RankTrace) -> list[dict]:
    out: list[dict] = []
    for key, name in _META:
        va, vb = a.meta.get(key), b.meta.get(key)
        if va is not None and vb is not None and va != vb:
            out.append({"name": name, "a": va, "b": vb})
    out += _model(a, b)
    out += _optimizers(a, b)
    out += _schedule(a, b)
    out += _precision(a, b)
    out += _batch(a, b)
    ca, cb = a.meta.get("config"), b.meta.get("config")
    if isinstance(ca, dict) and isinstance(cb, dict):
        for key in sorted(set(ca) & set(cb), key=str):
            if ca[key] != cb[key]:
                out.append({"name": f"recorder option {key}", "a": ca[key], "b": cb[key]})
    return out


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN:,} more" if len(names) > NAMES_SHOWN else "")


def _only(what: str, a: dict, b: dict) -> list[dict]:
    """Rows for the names (modules or parameters) one run has and the other has not."""
    out = []
    only_a, only_b = [n for n in a if n not in b], [n for n in b if n not in a]
    if only_a:
        out.append({"name": f"{what} only in A ({len(only_a):,})", "a": _listed(only_a), "b": None})
    if only_b:
        out.append({"name": f"{what} only in B ({len(only_b):,})", "a": None, "b": _listed(only_b)})
    return out


def _model(a: RankTrace, b: RankTrace) -> list[dict]:
    out = []
    ma, mb = dict(zip(a.module_names, a.module_types)), dict(zip(b.module_names, b.module_types))
    out += _only("modules", ma, mb)
    for m in ma:
        if m in mb and ma[m] != mb[m]:
            out.append({"name": f"type of {m or '(model)'}", "a": ma[m], "b": mb[m]})
    sa, sb = dict(zip(a.param_names, a.param_shapes)), dict(zip(b.param_names, b.param_shapes))
    out += _only("parameters", sa, sb)
    for p in sa:
        if p in sb and tuple(sa[p]) != tuple(sb[p]):
            out.append({"name": f"shape of {p}", "a": list(sa[p]), "b": list(sb[p])})
    return out


def _first_values(rt: RankTrace) -> dict[tuple, float]:
    """(optimizer, group, name) -> its value when first recorded."""
    h = rt.hyperparams
    first: dict[tuple, float] = {}
    for o, g, n, v in zip(h["optimizer"], h["group"], h["name"], h["value"]):
        first.setdefault((int(o), int(g), str(n)), float(v))
    return first


def _optimizers(a: RankTrace, b: RankTrace) -> list[dict]:
    out = []
    ca, cb = list(a.optimizers["class"]), list(b.optimizers["class"])
    if ca and cb and ca != cb:
        out.append({"name": "optimizer", "a": ", ".join(ca), "b": ", ".join(cb)})
    fa, fb = _first_values(a), _first_values(b)
    groups = {k[:2] for k in fa} | {k[:2] for k in fb}
    for key in sorted(set(fa) & set(fb)):
        va, vb = fa[key], fb[key]
        if va != vb and not (np.isnan(va) and np.isnan(vb)):
            o, g, n = key
            where = (f"optimizer {o}, " if len({k[0] for k in groups}) > 1 else "") + \
                    (f"group {g} " if len({k[1] for k in groups}) > 1 else "")
            out.append({"name": f"{where}{n}".strip(), "a": va, "b": vb})
    return out


def _common_rows(a: RankTrace, b: RankTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    steps, ia, ib = np.intersect1d(a.step_index, b.step_index, assume_unique=True, return_indices=True)
    return steps, ia, ib


def _schedule(a: RankTrace, b: RankTrace) -> list[dict]:
    """Where the two lr columns first differ, past their first step (the optimizers' rows tell that)."""
    steps, ia, ib = _common_rows(a, b)
    la, lb = a.columns["lr"].to_numpy(dtype=np.float64)[ia], b.columns["lr"].to_numpy(dtype=np.float64)[ib]
    known = np.isfinite(la) & np.isfinite(lb)
    differ = np.flatnonzero(known & (la != lb))
    if not differ.size or (differ[0] == 0 and len(a.hyperparams) and len(b.hyperparams)):
        return []
    i = int(differ[0])
    return [{"name": f"learning rate, first differs at step {int(steps[i]):,}", "a": float(la[i]), "b": float(lb[i])}]


def _precision(a: RankTrace, b: RankTrace) -> list[dict]:
    out = []
    sa, sb = (bool(np.isfinite(rt.columns["loss_scale"].to_numpy(dtype=np.float64)).any()) for rt in (a, b))
    if sa != sb:
        out.append({"name": "loss scaling (fp16 GradScaler)", "a": "on" if sa else "off", "b": "on" if sb else "off"})
    da, db = _output_dtype(a), _output_dtype(b)
    if da and db and da != db:
        out.append({"name": "model output dtype", "a": da, "b": db})
    return out


def _output_dtype(rt: RankTrace) -> str:
    mo = rt.module_outputs
    mine = mo[mo["module_index"] == 0]
    return str(mine["dtype"].iloc[0]) if len(mine) else ""


def _batch(a: RankTrace, b: RankTrace) -> list[dict]:
    """The batch as the model received it: its statistics' level over the first steps both hold.
    A scale (std, max) differs at _LEVEL_RATIO x; the mean when it moved by half a std."""
    _, ia, ib = _common_rows(a, b)
    ia, ib = ia[:_LEVEL_STEPS], ib[:_LEVEL_STEPS]
    level = {}
    for col in ("input_std", "input_max", "input_mean"):
        va = a.columns[col].to_numpy(dtype=np.float64)[ia]
        vb = b.columns[col].to_numpy(dtype=np.float64)[ib]
        ok = np.isfinite(va) & np.isfinite(vb)
        if ok.any():
            level[col] = (float(np.median(va[ok])), float(np.median(vb[ok])), int(ok.sum()))
    out = []
    for col, name in (("input_std", "batch std"), ("input_max", "batch max")):
        if col in level:
            la, lb, n = level[col]
            big, small = max(abs(la), abs(lb)), min(abs(la), abs(lb))
            if big > 0 and (small == 0 or big / small >= _LEVEL_RATIO):
                out.append({"name": f"{name} (median of the first {n} steps)", "a": la, "b": lb})
    if "input_mean" in level and "input_std" in level:
        la, lb, n = level["input_mean"]
        if abs(la - lb) >= 0.5 * max(level["input_std"][0], level["input_std"][1]) > 0:
            out.append({"name": f"batch mean (median of the first {n} steps)", "a": la, "b": lb})
    return out
