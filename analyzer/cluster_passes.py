"""The cross-rank stage on a Dask cluster, where the ranks are read (analyzer/cluster.py):

1. each rank's pass (its detectors, its digest) returns its findings and its Light
   (cross_rank/light.py: its series in buckets, its values around its findings' steps), never
   its per-step series;
2. the straggler's per-step references: KLL sketches of a group of ranks' series, made where
   they are read (LEAF ranks a task), merged FAN at a time up a tree and read off at its root
   (cross_rank/sketches.py); in the same tasks, the exact counters of the ranks' fingerprints
   and of where each stood at the end (cross_rank/counters.py), which the replica and hang
   detectors read: no process ever holds all ranks' rows;
3. each rank judged against them where it is read (straggler.verdict: exact per step given the
   references), with its peak memory up to the steps another rank ran out of memory at; only the
   verdict and those peaks come back.

Steps 2 and 3 read each rank's steps table again (its phases and memory: a small part of its
pass; step 2 also its fingerprints and heartbeats) rather than keeping every rank's digest in the workers' memory between
passes: a worker that dies loses nothing another task needs, as in step 1. Imported only on the
Dask path."""

from __future__ import annotations

from .cross_rank import counters, sketches, straggler
from .cross_rank.digest import timing_of
from .cross_rank.light import finding_steps, light, oom_steps, peak_by
from .parallel import _one_rank

LEAF = 32  # ranks sketched by one task
FAN = 8  # partials merged by one task


def first_pass(run_dir, files, rank, rank_pass, passed):
    """In a worker: a rank's pass, its findings and its Light (None where its digest could not be made)."""
    found, d = _one_rank(run_dir, files, rank, rank_pass, passed)
    return found, (None if d is None else light(d, finding_steps(found)))


def _digest(spec, ends=False):
    """In a worker: a rank's steps, phases and memory read again (with ``ends``, its fingerprints,
    heartbeats and end too); spec: (run_dir, files, rank, passed)."""
    run_dir, files, rank, passed = spec
    return _one_rank(run_dir, files, rank, lambda t, r: (None, timing_of(t.ranks[r], ends)), passed)[1]


def _leaf(specs, hang_cfg):
    """In a worker: the sketches and counters of a group of ranks."""
    ds = [_digest(s, ends=True) for s in specs]
    return sketches.leaf(ds), counters.leaf(ds, hang_cfg)


def _merge(*parts):
    return sketches.merged([p[0] for p in parts]), counters.merged([p[1] for p in parts])


def _refs(root):
    return sketches.refs(root[0])


def _counts(root):
    return root[1]


def _verdict(spec, refs, cfg, peak_steps):
    """In a worker: the rank's straggler verdict and its peaks (step -> its peak memory up to it)."""
    d = _digest(spec)
    return straggler.verdict(d, refs, cfg), {s: peak_by(d, s) for s in peak_steps}


def tree(client, specs: list, hang_cfg, tag: str):
    """Futures of the straggler's Refs and of the Counts over the ranks of ``specs``, made as one
    tree of tasks."""
    level = [client.submit(_leaf, specs[i:i + LEAF], hang_cfg, key=f"torchautopsy-sketch-{i}-{tag}", pure=False)
             for i in range(0, len(specs), LEAF)]
    depth = 0
    while len(level) > 1:
        depth += 1
        level = [client.submit(_merge, *level[i:i + FAN], key=f"torchautopsy-merge-{depth}-{i}-{tag}", pure=False)
                 for i in range(0, len(level), FAN)]
    return (client.submit(_refs, level[0], key=f"torchautopsy-refs-{tag}", pure=False),
            client.submit(_counts, level[0], key=f"torchautopsy-counts-{tag}", pure=False), level[0])


def judge(client, specs: dict, lights: dict, results: list, cfg, tag: str):
    """Steps 2-3 for the ranks of ``specs`` ({rank: (run_dir, files, rank, passed)}, whose
    digests were made): each one's Light in ``lights`` given its verdict and peaks; returns the
    ranks' merged Counts (``cfg``: the AnalysisConfig). A rank whose verdict task fails (its
    worker died each time) keeps no verdict; its own findings stand. None where the tree failed
    (a rank that could not be read again): the caller counts the ranks' ends read again
    in its own process (analyzer/run.py)."""
    if len(specs) < 2:
        return None
    peak_steps = oom_steps(results)
    refs, counts, root = tree(client, [specs[r] for r in sorted(specs)], cfg.hang, tag)
    futs = {client.submit(_verdict, specs[r], refs, cfg.straggler, peak_steps, key=f"torchautopsy-judge-{r}-{tag}",
                          pure=False): r for r in specs}
    try:
        try:
            merged = counts.result()
        except Exception:
            merged = None
        for fut, r in futs.items():
            try:
                lights[r].straggle, lights[r].peaks = fut.result()
            except Exception:
                lights[r].straggle, lights[r].peaks = None, {}
    finally:
        client.cancel([refs, counts, root, *futs], force=True)
    return merged
