"""The report's section on the ranks of a many-rank run: ranks x steps pictures of own work,
waiting, loss, gradient norm and memory, each rank against the median rank in buckets of steps,
so that the odd rank stands out; and how each rank's trace ends (where the hung rank stopped).
They read the ranks' Lights (analyzer/cross_rank/light.py): series bucketed where each rank was read,
and the ranks' merged counters (cross_rank/counters.py) for the replica picture."""

from __future__ import annotations

import datetime as _dt
import warnings

import numpy as np

from ..analyzer.cross_rank import counters
from ..analyzer.cross_rank.buckets import side_by_side
from ..analyzer.cross_rank.digest import digest_of
from ..analyzer.cross_rank.hang import where_stopped
from ..analyzer.cross_rank.light import Light, light
from ..analyzer.cross_rank.merge import rank_set
from ..analyzer.trace.phases import PHASES
from . import plots
from .context import Context, figure, no_figure
from .model import Figure, Table
from .rank_plots import plot_rank_heatmap

MAX_ROWS = 96  # ranks drawn one row each; more are grouped (the most deviating value of a group)
MAX_COLS = 400
MAX_TABLE_ROWS = 40


def digests(ctx: Context) -> dict[int, Light]:
    """The ranks' Lights: those the analysis made, else made here (a report built alone), with
    their counters (a group of ranks' full digests at a time, as the analysis makes them)."""
    if ctx.trace.digests is None:
        lights, leaves, rs = {}, [], sorted(ctx.trace.ranks)
        for i in range(0, len(rs), counters.LEAF):
            full = [digest_of(ctx.trace.ranks[r]) for r in rs[i:i + counters.LEAF]]
            leaves.append(counters.leaf(full, ctx.cfg.hang))
            lights.update({d.rank: light(d) for d in full})
        ctx.trace.digests, ctx.trace.counts = lights, counters.tree(leaves)
    return ctx.trace.digests


def counts(ctx: Context) -> counters.Counts | None:
    """The ranks' merged counters (None: the analysis could not make them)."""
    digests(ctx)
    return ctx.trace.counts


# (title, what it shows, the bucketed series of a digest, what a coloured row means)
PICTURES = (
    ("Ranks: own work per step", "each rank's own work in a step (waiting for its data, between steps, its "
     "forward)", "own",
     "A straggler is a red row: it takes longer than the others for its own work."),
    ("Ranks: backward and optimizer per step", "each rank's time from the end of its forward to rec.step() "
     "(its backward, the gradient all-reduce and the optimizer step)", "backward",
     "Under data parallelism the ranks wait for a straggler in the gradient all-reduce, so their backward "
     "grows by its delay: the straggler's row is the blue one, the rank that did not wait."),
    ("Ranks: loss per step", "each rank's loss (its own batch)", "loss",
     "A NaN in one rank's batch shows red on that rank first."),
    ("Ranks: gradient norm per step", "the total gradient norm each rank measured", "grad_norm",
     "After the all-reduce every replica holds the same gradients: rows differ only where the ranks do not "
     "average them."),
    ("Ranks: memory per step", "each rank's memory (the CUDA allocator's peak where measured, else its "
     "resident memory)", "memory", "A rank with more memory than the others is red: it runs out first."),
)


def bucket_lines(ds: dict[int, Light], name: str, odd=(), largest: bool = False, label: str = "",
                 median_label: str | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Many ranks' series as a few lines over the buckets' first steps: the median rank's (the
    median of the ranks' bucket means), the largest value of any rank if asked, and each rank of
    ``odd`` (its bucket means). {} if no rank has the series."""
    aligned = side_by_side({r: d.buckets for r, d in ds.items()}, name)
    if aligned is None:
        return {}
    ranks, edges, _, hi, mean, _, _ = aligned
    x = edges[:-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = {median_label or f"median of {len(ranks):,} ranks{label}": (x, np.nanmedian(mean, axis=0))}
        if largest:
            out[f"largest of any rank{label}"] = (x, np.nanmax(hi, axis=0))
    for r in odd:
        if r in ranks:
            out[f"rank {r}{label}"] = (x, mean[ranks.index(r)])
    return out


def figures(ctx: Context) -> list[Figure]:
    if len(ctx.trace.ranks) < 2:
        return []
    ds = digests(ctx)
    if len(ds) < 2:
        return [no_figure("Ranks", "Fewer than two ranks could be summarised; see the findings.")]
    if not any(d.n_steps for d in ds.values()):
        return [no_figure("Ranks", "No rank recorded a step.")]
    ranks = sorted(ds)
    points = [(ranks.index(f.rank), f.step, f.severity) for f in ctx.findings
              if f.rank in ds and f.step is not None and f.severity != "info"]
    out = []
    for title, what, series, meaning in PICTURES:
        cells = _cells(ds, series)
        if cells is None:
            out.append(no_figure(title, f"Not recorded: {what}."))
            continue
        dev, nonfinite, missing, labels, x_edges = cells
        caption = (f"One row per rank{' (groups of ranks: the most deviating of each)' if len(labels) < len(ranks) else ''}:"
                   f" {what}, against the median rank's, in buckets of steps (each cell the most deviating value "
                   f"of its steps against the median of the ranks' means there; white: as the median rank; red: more; "
                   f"blue: less). {meaning} Grey: no step recorded (the rank's trace had ended). Triangles: the "
                   f"findings of each rank.{_odd_in_groups(points, ranks, labels)}")
        height = float(np.clip(1.2 + 0.09 * len(labels), 1.8, 6.5))
        out.append(figure(title, caption, plot_rank_heatmap, dev, nonfinite, missing, labels, x_edges,
                          points=_grouped_points(points, len(ranks), len(labels)), cbar_label="against the median rank",
                          height_in=height))
    fp = _replicas(ctx, ds, ranks, points)
    return out + ([fp] if fp is not None else [])


def _replicas(ctx: Context, ds: dict[int, Light], ranks: list[int], points) -> Figure | None:
    """Each rank's parameters at each fingerprint step: the majority's (white) or not (red)."""
    c = counts(ctx)
    fp = None if c is None else c.fingerprints
    if fp is None or fp.steps is None or fp.members.tolist() != ranks:
        return None  # (a rank that is no replica, or recorded no fingerprint: no picture)
    dev, missing, labels, x_edges = replica_cells(fp)
    steps = fp.steps
    title = "Ranks: replica fingerprints"
    caption = ("One row per rank: at each step with replica fingerprints (every "
               f"{int(np.median(np.diff(steps))) if len(steps) > 1 else 1:,} steps), whether the rank's parameters "
               "equal the majority's bit for bit (white) or not (red). Under data parallelism every row stays white; "
               "a red row is a replica that left the others. Grey: no fingerprint recorded.")
    fp_points = [(i, s, sev) for i, s, sev in points
                 if any(f.kind == "replica_divergence" and f.step == s for f in ctx.findings)]
    return figure(title, caption, plot_rank_heatmap, dev, np.zeros(dev.shape, dtype=bool), missing, labels, x_edges,
                  points=_grouped_points(fp_points, len(ranks), len(labels)), binary="differs from the majority",
                  height_in=float(np.clip(1.2 + 0.09 * len(labels), 1.8, 6.5)))


def replica_cells(fp: counters.Fingerprints):
    """The replica picture's cells (dev: 4 where a rank of the row differs from the majority,
    missing: no rank of the row recorded a fingerprint there; its row labels and step edges), at
    most MAX_ROWS x MAX_COLS, from the counters: per step the majority and the ranks that left
    it (the majority's hash: the most common one, ties to the smallest rank's), not every rank's row."""
    ranks, steps = fp.members.tolist(), fp.steps
    rows = plots.bucket_edges(len(ranks), MAX_ROWS)
    row_of = lambda rs: np.searchsorted(rows, np.searchsorted(fp.members, rs), "right") - 1  # noqa: E731
    size = np.diff(rows)
    differs = np.zeros((len(size), len(steps)), dtype=bool)
    absent = np.zeros(differs.shape, dtype=np.int64)  # (per row: how many of its ranks recorded no fingerprint)
    for k, t in enumerate(fp.at):
        held = [v for v in t.count if v != counters.ABSENT]
        top = min(held, key=lambda v: (-t.count[v], t.first[v]), default=None)
        for v in held:
            if v != top:
                differs[row_of(t.ranks_of(v)), k] = True
        if counters.ABSENT in t.count:
            absent[:, k] = np.bincount(row_of(t.ranks_of(counters.ABSENT)), minlength=len(size))
    cols = plots.bucket_edges(len(steps), MAX_COLS)
    dev, _, missing = _by_columns(np.where(differs, 4.0, 0.0), np.zeros(differs.shape, dtype=bool),
                                  absent == size[:, None], cols)
    return dev, missing, _row_labels(ranks, rows), np.append(steps[cols[:-1]], steps[-1] + 1).astype(float)


def _cells(ds: dict[int, Light], series: str):
    """The picture's cells of one bucketed series: each bucket's smallest or largest value of a
    rank, whichever deviates more from the median of the ranks' bucket means (log2 of the ratio,
    NaN/Inf apart), then ranks grouped into at most MAX_ROWS rows; None if no value is finite."""
    aligned = side_by_side({r: d.buckets for r, d in ds.items()}, series)
    if aligned is None:
        return None
    ranks, edges, lo, hi, mean, nonfinite, missing = aligned
    if not (np.isfinite(lo).any() or np.isfinite(hi).any()):
        return None
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.abs(np.nanmedian(mean, axis=0))
        devs = []
        for v in (lo, hi):
            dev = np.log2(np.abs(v) / med)
            dev[np.abs(v) == med] = 0.0  # (0/0: both zero)
            devs.append(dev)
        dev = np.where(np.abs(np.nan_to_num(devs[0])) > np.abs(np.nan_to_num(devs[1])), devs[0], devs[1])
    return (*_by_rows(np.clip(dev, -4, 4), nonfinite, missing, ranks), edges)


def _most(a, edges, axis):
    """The most deviating value of each bucket (``edges``) along ``axis``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        hi, lo = np.fmax.reduceat(a, edges[:-1], axis=axis), np.fmin.reduceat(a, edges[:-1], axis=axis)
    return np.where(np.abs(lo) > np.abs(np.nan_to_num(hi)), lo, hi)


def _by_columns(dev, nonfinite, missing, cols):
    return (_most(dev, cols, 1), np.logical_or.reduceat(nonfinite, cols[:-1], axis=1),
            np.logical_and.reduceat(missing, cols[:-1], axis=1))


def _by_rows(dev, nonfinite, missing, ranks):
    rows = plots.bucket_edges(len(ranks), MAX_ROWS)
    return (_most(dev, rows, 0), np.logical_or.reduceat(nonfinite, rows[:-1], axis=0),
            np.logical_and.reduceat(missing, rows[:-1], axis=0), _row_labels(ranks, rows))


def _row_labels(ranks, rows) -> list[str]:
    return [f"rank {ranks[a]}" if b - a == 1 else f"ranks {ranks[a]}-{ranks[b - 1]}" for a, b in zip(rows[:-1], rows[1:])]


def _odd_in_groups(points, ranks: list[int], labels: list[str]) -> str:
    """Where rows are groups of ranks, the ranks with findings named with their group's row
    (" Ranks with findings: 17 (row ranks 11-21), 42 (row ranks 33-43)."), the first 12."""
    if len(labels) == len(ranks) or not points:
        return ""
    edges = plots.bucket_edges(len(ranks), MAX_ROWS)
    odd = sorted({i for i, _, _ in points})
    named = [f"{ranks[i]} (row {labels[int(np.searchsorted(edges, i, 'right') - 1)]})" for i in odd[:12]]
    return f" Ranks with findings: {', '.join(named)}{', ...' if len(odd) > 12 else ''}."


def _grouped_points(points, n_ranks, n_rows):
    if n_rows == n_ranks:
        return points
    edges = plots.bucket_edges(n_ranks, MAX_ROWS)
    return [(int(np.searchsorted(edges, i, "right") - 1), s, sev) for i, s, sev in points]


def end_table(ctx: Context) -> Table | None:
    """How each rank's trace ends: its last step, how it ended, and where its last heartbeat found
    it (a hang); ranks that ended alike share a row. None for one rank, or when every rank closed."""
    if len(ctx.trace.ranks) < 2:
        return None
    ds = digests(ctx)
    if all(d.closed_cleanly for d in ds.values()):
        return None
    cfg = ctx.cfg.hang
    groups: dict[tuple, list[int]] = {}
    stalled: dict[tuple, list[float]] = {}
    for r, d in sorted(ds.items()):
        w = where_stopped(d, cfg)
        end = "closed" if d.closed_cleanly else (d.end_reason or "killed (not closed)")
        last = d.last_step if d.last_step is not None else -1
        order = (w["step"], PHASES.index(w["phase"]) if w["phase"] in PHASES else 0) if w else (last + 1, -1)
        key = (order, last, end[:80], f"step {w['step']:,}, {w['phase']}" if w else "", w["at"] if w else "")
        groups.setdefault(key, []).append(r)
        stalled.setdefault(key, []).append(w["stalled_s"] if w else float("nan"))
    rows = []
    for key, rs in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        s = [x for x in stalled[key] if x == x]
        took = "" if not s else (f"{min(s):,.0f}" if round(min(s)) == round(max(s)) else f"{min(s):,.0f}-{max(s):,.0f}")
        clock = min((_clock(ds[r]) for r in rs), default="")
        rows.append((rank_set(rs, sorted(ds)).removeprefix("ranks ").removeprefix("rank "), f"{key[1]:,}", key[2],
                     key[3], key[4], took, clock))
    more = f"{len(rows) - MAX_TABLE_ROWS:,} more groups of ranks" if len(rows) > MAX_TABLE_ROWS else ""
    return Table("How each rank's trace ends",
                 "Ranks whose traces end alike share a row, the rank that stopped first at the top: its last "
                 "finished step, how its trace ended, where its last heartbeat found it (the step in progress and "
                 "its phase; the line of the job's own code its Python stack was in) and for how long that step "
                 "had run; the time of its last step (UTC).",
                 ("ranks", "last step", "end", "stopped in", "at", "stalled s", "last step at"),
                 rows[:MAX_TABLE_ROWS], (False, True, False, False, False, True, False), more=more,
                 widths=(12, 9, 22, 16, 18, 8, 15))


def _clock(d: Light) -> str:
    if not np.isfinite(d.last_time):
        return ""
    try:
        return _dt.datetime.fromtimestamp(d.last_time, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):  # (a time no clock shows: a damaged trace)
        return ""
