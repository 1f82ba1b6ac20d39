"""The cross-rank stage on a Dask cluster, where the ranks are read (analyzer/cluster.py):

1. each rank's pass (its detectors, its digest) returns its findings and its Light
   (cross_rank/light.py: its series in buckets, its values around its findings' steps), never
   its per-step series;
2. the straggler's per-step references: KLL sketches of a group of ranks' series, made where
   they are read (LEAF ranks a task), merged FAN at a time up a tree and read off at its root
   (cross_rank/sketches.py): no process ever holds all ranks' rows;
3. each rank judged against them where it is read (straggler.verdict: exact per step given the
   references), with its peak memory up to the steps another rank ran out of memory at; only the
   verdict and those peaks come back.

Steps 2 and 3 read each rank's steps table again (its phases and memory: a small part of its
pass) rather than keeping every rank's digest in the workers' memory between
passes: a worker that dies loses nothing another task needs, as in step 1. Imported only on the
Dask path."""

from __future__ import annotations

from .cross_rank import sketches, straggler
from .cross_rank.digest import timing_of
from .cross_rank.light import finding_steps, light, oom_steps, peak_by
from .parallel import _one_rank

LEAF = 32  # ranks sketched by one task
FAN = 8  # partials merged by one task


def first_pass(run_dir, files, rank, rank_pass, passed):
    """In a worker: a rank's pass, its findings and its Light (None where its digest could not be made)."""
    found, d = _one_rank(run_dir, files, rank, rank_pass, passed)
    return found, (None if d is None else light(d, finding_steps(found)))


def _digest(spec):
    """In a worker: a rank's steps, phases and memory read again; spec: (run_dir, files, rank, passed)."""
    run_dir, files, rank, passed = spec
    return _one_rank(run_dir, files, rank, lambda t, r: (None, timing_of(t.ranks[r])), passed)[1]


def _leaf(specs):
    return sketches.leaf([_digest(s) for s in specs])


def _merge(*parts):
    return sketches.merged(list(parts))


def _verdict(spec, refs, cfg, peak_steps):
    """In a worker: the rank's straggler verdict and its peaks (step -> its peak memory up to it)."""
    d = _digest(spec)
    return straggler.verdict(d, refs, cfg), {s: peak_by(d, s) for s in peak_steps}


def refs_future(client, specs: list, tag: str):
    """A future of the straggler's Refs over the ranks of ``specs``, made as a tree of tasks."""
    level = [client.submit(_leaf, specs[i:i + LEAF], key=f"torchautopsy-sketch-{i}-{tag}", pure=False)
             for i in range(0, len(specs), LEAF)]
    depth = 0
    while len(level) > 1:
        depth += 1
        level = [client.submit(_merge, *level[i:i + FAN], key=f"torchautopsy-merge-{depth}-{i}-{tag}", pure=False)
                 for i in range(0, len(level), FAN)]
    return client.submit(sketches.refs, level[0], key=f"torchautopsy-refs-{tag}", pure=False)


def judge(client, specs: dict, lights: dict, results: list, cfg, tag: str) -> None:
    """Steps 2-3 for the ranks of ``specs`` ({rank: (run_dir, files, rank, passed)}, whose
    digests were made): each one's Light in ``lights`` given its verdict and peaks. A rank whose
    verdict task fails (its worker died each time) keeps no verdict; its own findings stand."""
    if len(specs) < 2:
        return
    peak_steps = oom_steps(results)
    refs = refs_future(client, [specs[r] for r in sorted(specs)], tag)
    futs = {client.submit(_verdict, specs[r], refs, cfg, peak_steps, key=f"torchautopsy-judge-{r}-{tag}",
                          pure=False): r for r in specs}
    try:
        for fut, r in futs.items():
            try:
                lights[r].straggle, lights[r].peaks = fut.result()
            except Exception:
                lights[r].straggle, lights[r].peaks = None, {}
    finally:
        client.cancel([refs, *futs], force=True)
