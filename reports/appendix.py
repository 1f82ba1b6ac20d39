"""The appendix: the last recorded statistics of every layer, and what the trace holds and what
it does not (so a reader knows which questions it can answer)."""

from __future__ import annotations

import numpy as np

from ..analyzer.errors import TraceError
from ..analyzer.export import describe_stored
from ..analyzer.findings import Finding
from ..analyzer.series import spacing
from ..analyzer.trace import measured_rows
from ..analyzer.trace.format import OWN_WORK_RANGE
from .context import Context, read_or_none
from .format import REPORT_NAME_CHARS, format_number, plural, shorten, shorten_words
from .model import Recorded, Table

# Tables are cut to this many rows (the ones findings name are kept); the rest is counted.
MAX_ROWS = 200
# The model summary (print(model)) is cut to this many lines, of at most this many characters.
MAX_SUMMARY_LINES = 150
MAX_SUMMARY_LINE_CHARS = 200


def parameter_table(ctx: Context) -> Table:
    rt = ctx.focus
    title = "Parameters" + (f" (rank {rt.rank})" if len(ctx.trace.ranks) > 1 else "")
    cols = ("parameter", "shape", "grad L2", "grad max |g|", "weight L2", "update ratio", "NaN/Inf grad steps")
    if rt.n_steps == 0 or not rt.param_names:
        return Table(title, "No parameter statistics were recorded.", cols, [], (False,) * len(cols))
    keep, more = _rows_kept(rt.param_names, ctx.findings, rt.rank)
    # A run that went NaN has NaN in every statistic of its last step: show the last step whose
    # gradient norm was finite instead, and say how many came after it. Only that row is read.
    i = _last_finite_row(rt.total_grad_norm.to_numpy())
    at = int(rt.step_index[i])
    g = read_or_none(lambda: rt.param_stat("grad_norm", rows=[i]))
    # max |g| and the weight norm are measured on watched steps: the last one up to step i.
    gmax, w = (read_or_none(lambda s=s: _last_measured(rt.param_stat(s, rows=slice(max(0, i - LOOK_BACK), i + 1))))
               for s in ("grad_absmax", "param_norm"))
    sampled = read_or_none(lambda: rt.sample_steps("updates"))
    k = int(np.searchsorted(sampled, at, "right")) - 1 if sampled is not None else -1
    upd = read_or_none(lambda: rt.update_ratio(rows=[k])) if k >= 0 else None
    last_upd = upd.iloc[0] if upd is not None and len(upd) else None
    bad_steps = read_or_none(lambda: _steps_with_nonfinite(rt))
    rows = []
    for j in keep:
        n = rt.param_names[j]
        rows.append((shorten(n, REPORT_NAME_CHARS), "×".join(map(str, rt.param_shapes[j])) or "scalar",
                     _at(g, 0, j), _at(gmax, 0, j), _at(w, 0, j),
                     format_number(last_upd.iloc[j]) if last_upd is not None else "",
                     f"{int(bad_steps[j]):,}" if bad_steps is not None else ""))
    caption = f"At step {at:,}, " + (
        "the last recorded step" if i == rt.n_steps - 1 else
        f"the last step whose gradients were all finite ({rt.n_steps - 1 - i:,} steps after it were not)")
    if last_upd is not None:
        caption += f"; update ratio at step {int(last_upd.name):,}, the last sampled by then"
    caption += ". NaN/Inf grad steps: how many steps' gradients held NaN or Inf."
    return Table(title, caption, cols, rows, (False, False, True, True, True, True, True),
                 more=_more(more, "parameter"), widths=(34, 12, 10, 10, 10, 10, 10))


# Tensor groups listed for the memory peak.
MAX_GROUPS = 10


def memory_peak_table(ctx: Context) -> Table | None:
    """What held the memory at its peak: the largest tensor groups of the census nearest the
    step of peak memory (CUDA allocated on a GPU, else RSS). None without a census."""
    rt = ctx.focus
    groups = read_or_none(lambda: rt.census_groups)
    if groups is None or not len(groups) or rt.n_steps == 0:
        return None
    steps = rt.columns
    cuda = bool((steps["cuda_allocated_bytes"] >= 0).all())
    mem = steps["cuda_allocated_bytes" if cuda else "rss_bytes"].to_numpy(dtype=float)
    i = int(np.nanargmax(mem))
    peak_step = int(rt.step_index[i])
    census_steps = np.array(sorted(groups["step"].unique()))
    at = int(census_steps[np.argmin(np.abs(census_steps - peak_step))])
    top = groups[groups["step"] == at].sort_values("bytes", ascending=False)
    cols = ("device", "dtype", "shape", "autograd graph", "tensors", "MiB")
    rows = [(r.device, r.dtype, r.shape, "yes" if r.graph else "", f"{int(r.count):,}",
             format_number(r.bytes / 2**20)) for r in top.head(MAX_GROUPS).itertuples()]
    what = "GPU memory allocated by tensors" if cuda else "resident memory"
    caption = (f"The {what} peaked at {mem[i] / 2**20:,.0f} MiB at step {peak_step:,}. The census nearest "
               f"to it, at step {at:,}, found these tensor groups (same device, dtype and shape) holding the "
               f"most bytes; storages shared by views count once.")
    return Table("Memory at its peak" + (f" (rank {rt.rank})" if len(ctx.trace.ranks) > 1 else ""), caption,
                 cols, rows, (False, False, False, False, True, True),
                 more=(f"{plural(len(top) - MAX_GROUPS, 'more group')} in trace.ranks[r].census_groups"
                       if len(top) > MAX_GROUPS else ""), widths=(10, 10, 24, 12, 10, 10))


def cuda_memory_sites_table(ctx: Context) -> Table | None:
    """What held the CUDA memory at its peak, by allocation site: the allocator snapshot with the
    most memory allocated, walked back through its history to the moment of most memory (its
    live blocks as they were then), grouped by the line of the job's code that allocated them.
    None without CUDA snapshots."""
    from ..analyzer.memory_snapshot import history_peak, live_sites

    rt = ctx.focus
    snaps = read_or_none(lambda: rt.memory_snapshots)
    if snaps is None or not len(snaps):
        return None
    row = snaps.iloc[int(np.argmax(snaps["allocated_bytes"].to_numpy()))]
    n, step = int(row["snapshot"]), int(row["step"])
    peak = read_or_none(lambda: history_peak(rt, n, top=MAX_GROUPS))
    if peak is not None:
        sites, total = peak["sites"], peak["bytes"]
        when = (f"the moment of most memory in the allocator's history up to snapshot {n} (step {step:,}, "
                f"{row['reason']}): {total / 2**20:,.0f} MiB live")
    else:
        sites = read_or_none(lambda: live_sites(rt, n, top=MAX_GROUPS)) or []
        when = (f"allocator snapshot {n} (step {step:,}, {row['reason']}), the one with the most memory "
                f"allocated ({int(row['allocated_bytes']) / 2**20:,.0f} MiB)")
    cols = ("allocation site", "MiB", "blocks", "called from")
    rows = [(shorten(g["site"], 160), format_number(g["bytes"] / 2**20), f"{g['blocks']:,}",
             shorten(" <- ".join(g["stack"][1:4]), 300)) for g in sites]
    caption = (f"CUDA memory by the line of the job's code that allocated it (frames inside torch left "
               f"out), at {when}. The whole snapshot opens in https://pytorch.org/memory_viz: "
               f"torchautopsy export RUN_DIR --memory-snapshot OUT.pickle --which {n}.")
    return Table("CUDA memory at its peak, by allocation site"
                 + (f" (rank {rt.rank})" if len(ctx.trace.ranks) > 1 else ""), caption, cols, rows,
                 (False, True, True, False), widths=(34, 10, 8, 48))


# Operators listed from a profiler window.
MAX_OPS = 15


def profile_table(ctx: Context) -> Table | None:
    """The slowest operators (self CPU time) of the last profiler window, or None without one."""
    rt = ctx.focus
    windows = read_or_none(lambda: rt.profile_windows)
    if windows is None or not len(windows):
        return None
    last = windows.iloc[-1]
    w = int(last["window"])
    ops = read_or_none(lambda: rt.profile_ops(w))
    if ops is None or not len(ops):
        return None
    steps = int(last["step_end"]) - int(last["step_start"]) + 1
    cpu_total = float(ops["cpu_self_us"].sum()) or 1.0
    dev = bool((ops["device_self_us"] > 0).any())
    cols = ("operator", "calls", "self CPU ms / step", "share of CPU") + (("self device ms / step",) if dev else ())
    rows = []
    for r in ops.head(MAX_OPS).itertuples():
        name = (f"{OWN_WORK_RANGE} (the recorder's own work)" if r.name == OWN_WORK_RANGE
                else shorten(r.name, REPORT_NAME_CHARS))
        row = (name, f"{int(r.calls):,}",
               format_number(r.cpu_self_us / 1e3 / steps),
               f"{r.cpu_self_us / cpu_total:.0%}")
        rows.append(row + ((format_number(r.device_self_us / 1e3 / steps),) if dev else ()))
    caption = (f"torch.profiler window {w}, steps {int(last['step_start']):,}-{int(last['step_end']):,}: the "
               f"{min(MAX_OPS, len(ops))} operators with the most self CPU time, per step (what the recorder "
               f"ran in the window is one row, {OWN_WORK_RANGE}). The whole window "
               f"opens in Perfetto: torchautopsy export RUN_DIR --profile OUT.json --window {w}.")
    return Table("Slowest operators" + (f" (rank {rt.rank})" if len(ctx.trace.ranks) > 1 else ""), caption,
                 cols, rows, (False,) + (True,) * (len(cols) - 1),
                 more=(f"{plural(len(ops) - MAX_OPS, 'more operator')} in trace.ranks[r].profile_ops({w})"
                       if len(ops) > MAX_OPS else ""),
                 widths=(40, 10, 16, 12) + ((16,) if dev else ()))


def module_table(ctx: Context) -> Table:
    rt = ctx.focus
    title = "Modules" + (f" (rank {rt.rank})" if len(ctx.trace.ranks) > 1 else "")
    cols = ("module", "type", "max |output|", "output mean", "output std", "zero share", "dead units")
    if rt.n_steps == 0 or not rt.module_names:
        return Table(title, "No module statistics were recorded.", cols, [], (False,) * len(cols))
    all_finite = np.zeros(rt.n_steps, dtype=bool)  # and measured (watched)
    for a, block in rt.blocks("modules/output_absmax"):
        all_finite[a:a + len(block)] = np.isfinite(block).all(axis=1) & measured_rows(block)
    i = _last_finite_row(np.where(all_finite, 0.0, np.nan))
    at = int(rt.step_index[i])
    out = rt.module_rows(rows=[i])
    sampled = read_or_none(lambda: rt.sample_steps("activations"))
    k = int(np.searchsorted(sampled, at, "right")) - 1 if sampled is not None else -1
    act_row = {}
    for s in ("mean", "std", "zero_frac"):
        a = read_or_none(lambda s=s: rt.activation_stat(s, rows=[k])) if k >= 0 else None
        act_row[s] = a.iloc[0] if a is not None and len(a) else None
    dead = ctx.dead_shares(rt)
    dead_last = dead.ffill().iloc[-1] if dead is not None and len(dead) else None
    keep, more = _rows_kept(rt.module_names, ctx.findings, rt.rank)
    rows = []
    for j in keep:
        n = rt.module_names[j]
        absmax = out.iat[0, j]
        rows.append((shorten(n, REPORT_NAME_CHARS) or "(model)", shorten(rt.module_types[j], REPORT_NAME_CHARS),
                     "not called" if absmax == -1 else format_number(absmax),
                     *(format_number(r.iloc[j]) if r is not None else "" for r in act_row.values()),
                     f"{dead_last[n]:.0%}" if dead_last is not None and n in dead_last.index
                     and np.isfinite(dead_last[n]) else ""))
    act_step = act_row["mean"].name if act_row["mean"] is not None else None
    caption = (f"max |output| at step {at:,}, " + (
        "the last recorded step" if i == rt.n_steps - 1 else
        f"the last step whose module outputs were all finite ({rt.n_steps - 1 - i:,} steps after it were not)")
        + "; mean, std and share of zeros of the output at the last sampled step by then"
        + (f" ({int(act_step):,})" if act_step is not None else " (none recorded)")
        + "; dead units: the share of an activation's units never positive in the last window.")
    return Table(title, caption, cols, rows, (False, False, True, True, True, True, True),
                 more=_more(more, "module"), widths=(30, 19, 10, 10, 10, 10, 10))


def recorded(ctx: Context) -> list[Recorded]:
    """What the trace holds, and what it does not, for the focus rank."""
    rt = ctx.focus
    cfg = rt.meta.get("config", {}) if isinstance(rt.meta.get("config"), dict) else {}
    out = []
    n = rt.n_steps
    loss = rt.columns["loss"].to_numpy() if n else np.zeros(0)
    given = int(np.isfinite(loss).sum())
    out.append(Recorded("Loss", given > 0, f"finite at {given:,} of {n:,} steps" if given else
                        "never given (call rec.step(loss=loss))"))
    has_g = n > 0 and bool(rt.param_names) and not rt.digest.grad_absent.all()
    out.append(Recorded("Gradient norms, max |g|, NaN/Inf counts", has_g,
                        f"every step, {plural(len(rt.param_names), 'parameter tensor')}" if has_g else
                        "no gradient at any rec.step() (call it after optimizer.step(), before zero_grad())"))
    out.append(Recorded("Weight norms", n > 0, f"every step, {plural(len(rt.param_names), 'tensor')}"))
    watched = read_or_none(lambda: rt.sample_steps("activations"))
    out.append(Recorded("Module outputs (max |x|, where NaN/Inf was born)", n > 0 and bool(rt.module_names),
                        f"{plural(len(rt.module_names), 'module')}, on the watched steps"
                        + (f" ({which_steps(watched)})" if watched is not None and len(watched) else "")
                        + " and any step that went NaN/Inf"))
    out.append(_sampled("Activation statistics (mean, std, zero share)", read_or_none(lambda: rt.sample_steps("activations")),
                        "activations_every"))
    out.append(_sampled("Update-to-weight ratios", read_or_none(lambda: rt.sample_steps("updates")), "update_ratio_every"))
    dead = ctx.dead_shares(rt)
    sites = read_or_none(lambda: rt.activity_sites)
    out.append(Recorded("Per-unit activity (dead units)", dead is not None,
                        f"{plural(len(dead), 'window')} of {cfg.get('activity_window', '?')} steps, "
                        f"{plural(len(sites), 'activation')}" if dead is not None else
                        "no ReLU-family, GELU, tanh or sigmoid activation was seen"
                        if "activity_window" in cfg else "not recorded by this recorder version"))
    att_sites = read_or_none(lambda: rt.attention_sites)
    att = ctx.attention(rt, "entropy") if att_sites is not None and len(att_sites) else None
    out.append(Recorded("Attention per head (entropy, sink share, similarity)", att is not None and len(att) > 0,
                        f"{plural(len(att_sites), 'attention layer')}, {plural(len(att), 'sampled step')}"
                        if att is not None and len(att) else "no attention layer was seen (nn.MultiheadAttention "
                        "or F.scaled_dot_product_attention)"))
    steps = rt.columns
    out.append(Recorded("Resident memory (RSS)", n > 0 and bool((steps["rss_bytes"] >= 0).any()), "every step"))
    cuda = n > 0 and bool((steps["cuda_allocated_bytes"] >= 0).any())
    out.append(Recorded("CUDA memory (allocated, reserved, peak)", cuda,
                        "every step" if cuda else f"no GPU (device: {rt.meta.get('device', 'unknown')})"))
    census = int((steps["live_tensors"] >= 0).sum()) if n else 0
    out.append(Recorded("Census of live tensors", census > 0,
                        f"{census:,} {'census' if census == 1 else 'censuses'}, every {cfg.get('census_every', '?')} steps or fewer"
                        if census else "not recorded"))
    timed = int(np.isfinite(steps["forward_s"].to_numpy()).sum()) if n else 0
    loader = bool(np.isfinite(steps["data_wait_s"].to_numpy()).any()) if n else False
    out.append(Recorded("Step time by phase", timed > 0,
                        f"every step; DataLoader wait {'timed' if loader else 'not seen (no DataLoader used)'}"
                        if timed else "not recorded by this recorder version"))
    windows = read_or_none(lambda: rt.profile_windows)
    nw = 0 if windows is None else len(windows)
    out.append(Recorded("torch.profiler windows", nw > 0,
                        f"{plural(nw, 'window')} at steps " + ", ".join(
                            f"{int(a):,}-{int(b):,}" for a, b in zip(windows["step_start"][:6], windows["step_end"][:6]))
                        + (" ..." if nw > 6 else "") + " (torchautopsy export RUN_DIR --profile OUT.json)"
                        if nw else "none (the run ended before the first window, or profile_steps=0)"))
    snaps = read_or_none(lambda: rt.memory_snapshots)
    ns = 0 if snaps is None else len(snaps)
    out.append(Recorded("CUDA allocator snapshots and history", ns > 0,
                        f"{plural(ns, 'snapshot')} at steps " + ", ".join(f"{int(x):,}" for x in snaps["step"][:6])
                        + (" ..." if ns > 6 else "") + " (torchautopsy export RUN_DIR --memory-snapshot OUT.pickle)"
                        if ns else "none (recorded on CUDA models only)"))
    ooms = read_or_none(lambda: rt.oom_events)
    if ooms is not None and len(ooms):
        out.append(Recorded("Out-of-memory events", True, f"{plural(len(ooms), 'event')}, first at step "
                            f"{int(ooms['step'].iloc[0]):,}"))
    try:
        out += [Recorded(what, ok, detail) for what, ok, detail in describe_stored(rt)]
    except TraceError as e:
        out.append(Recorded("Snapshots, samples, black box", False, f"unreadable ({e})"))
    dropped = int(rt.meta.get("dropped_steps", 0) or 0)
    out.append(Recorded("Every step", dropped == 0, "no step dropped" if not dropped else
                        f"{plural(dropped, 'step')} dropped: the writer fell behind"))
    return out


def model_summary(ctx: Context) -> str:
    lines = str(ctx.focus.meta.get("model_summary", "")).splitlines()
    text = "\n".join(shorten_words(line, MAX_SUMMARY_LINE_CHARS, MAX_SUMMARY_LINE_CHARS)
                     for line in lines[:MAX_SUMMARY_LINES])
    if len(lines) > MAX_SUMMARY_LINES:
        text += f"\n… {len(lines) - MAX_SUMMARY_LINES:,} more lines"
    return text


def _sampled(what: str, steps, option: str) -> Recorded:
    """A sampled table's line: how many samples, and how far apart (budgets widen the gaps)."""
    if steps is None or not len(steps):
        return Recorded(what, False, f"none recorded (Recorder option {option})")
    return Recorded(what, True, which_steps(steps))


def which_steps(steps) -> str:
    """``"every 10 steps: 12 samples, steps 0-110"`` or ``"37 samples: steps 0, 10, 20, …, 1,950"``:
    on which steps something was measured."""
    steps = np.asarray(steps)
    every = spacing(steps)
    if every:
        return f"every {every} steps: {plural(len(steps), 'sample')}, steps {int(steps[0]):,}-{int(steps[-1]):,}"
    shown = ", ".join(f"{int(s):,}" for s in steps[:4])
    return f"{plural(len(steps), 'sample')}: steps {shown}" + (f", …, {int(steps[-1]):,}" if len(steps) > 4 else "")


def _steps_with_nonfinite(rt) -> np.ndarray:
    """Per parameter, how many steps' gradients held NaN/Inf (one pass, a block at a time)."""
    count = np.zeros(len(rt.param_names), dtype=np.int64)
    for _, block in rt.blocks("params/grad_nonfinite"):
        count += (block > 0).sum(axis=0)
    return count



def _last_finite_row(x: np.ndarray) -> int:
    """The last row whose value is finite, else the last row."""
    ok = np.flatnonzero(np.isfinite(x))
    return int(ok[-1]) if ok.size else len(x) - 1


# Rows looked back for the last watched step (every activations_every-th: 10 by default).
LOOK_BACK = 256


def _last_measured(frame):
    """The last row of a statistic measured on watched steps only (-1 elsewhere), as a one-row
    frame; empty if none of these rows was measured."""
    ok = np.flatnonzero(measured_rows(frame.to_numpy()))
    return frame.iloc[ok[-1:]]


def _at(frame, i: int, j: int) -> str:
    return format_number(frame.iat[i, j]) if frame is not None and len(frame) else ""


def _rows_kept(names: list[str], findings: list[Finding], rank: int) -> tuple[list[int], int]:
    """Indices of the rows shown: all, or the ones findings name and then the first ones."""
    if len(names) <= MAX_ROWS:
        return list(range(len(names))), 0
    named = {w for f in findings if f.rank in (None, rank) for w in f.where}
    pinned = [j for j, n in enumerate(names) if n in named][: MAX_ROWS // 2]
    rest = [j for j in range(len(names)) if j not in set(pinned)][: MAX_ROWS - len(pinned)]
    return sorted(pinned + rest), len(names) - len(pinned) - len(rest)


def _more(n: int, what: str) -> str:
    return (f"{plural(n, 'more ' + what)} not shown (read them with torchautopsy.load(run_dir): "
            f"trace.ranks[r].param_stat(...) / .module_stat())") if n else ""
