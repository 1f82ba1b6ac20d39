"""The cross-rank stage's reductions (analyzer/cross_rank/): the straggler's per-step references,
exact (sorted) and from KLL sketches merged in a tree, give each rank the median of the *other*
ranks exactly as np.nanmedian does (exactly while the sketches hold every value; within KLL's rank
error beyond); a rank's buckets and its Light are what the parent keeps, bounded whatever the steps."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

from torchautopsy.analyzer.cross_rank import sketches, step_refs
from torchautopsy.analyzer.cross_rank.buckets import Buckets, side_by_side, width_for
from torchautopsy.analyzer.cross_rank.digest import PHASE_COLUMNS, RankDigest
from torchautopsy.analyzer.cross_rank.light import light, near_at, peak_by


def digest(rank: int, own: np.ndarray, steps=None, backward=None) -> RankDigest:
    """A rank's digest whose forward is ``own`` (its other own phases 0) at ``steps``."""
    n = len(own)
    steps = np.arange(n) if steps is None else np.asarray(steps)
    z = np.zeros(n, np.float32)
    phases = {k: z.copy() for k in PHASE_COLUMNS}
    phases["forward"] = np.asarray(own, np.float32)
    phases["backward"] = np.asarray(backward if backward is not None else np.full(n, 0.1), np.float32)
    rng = np.random.default_rng(rank)
    return RankDigest(rank=rank, file=f"rank{rank}.h5", steps=steps.astype(np.int64), time_unix=steps * 0.3 + 1e9,
                      loss=rng.normal(2, 0.1, n), phases=phases, grad_norm=np.ones(n), local_grad=rng.normal(1, .1, n),
                      memory=np.cumsum(rng.integers(0, 9, n)).astype(float), memory_kind="rss", replicated=True,
                      param_names=["w"], fp_steps=np.zeros(0, np.int64), fp_hash=np.zeros(0, np.int64),
                      closed_cleanly=True, end_reason="")


def _others_median(m: np.ndarray) -> np.ndarray:
    """np.nanmedian of the other rows, row by row (ranks x steps)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.stack([np.nanmedian(np.delete(m, i, axis=0), axis=0) for i in range(len(m))])


@pytest.mark.parametrize("n_ranks", [2, 3, 4, 7, 40])
def test_exact_and_sketched_references_give_each_rank_the_median_of_the_others(n_ranks):
    rng = np.random.default_rng(n_ranks)
    m = rng.choice([0.1, 0.2, 0.3, 0.25], size=(n_ranks, 30)).astype(np.float32).astype(float)  # (ties)
    m[rng.random(m.shape) < 0.1] = np.nan
    ds = {r: digest(r, m[r]) for r in range(n_ranks)}
    steps = np.arange(30)
    exact = step_refs.exact(ds, steps)
    # The tree of KLL partials: ranks in groups of 3, merged two at a time.
    parts = [sketches.leaf([ds[r] for r in range(i, min(i + 3, n_ranks))]) for i in range(0, n_ranks, 3)]
    while len(parts) > 1:
        parts = [sketches.merged(parts[i:i + 2]) for i in range(0, len(parts), 2)]
    sketched = sketches.refs(parts[0])
    want = _others_median(np.nan_to_num(m))  # (own work: its phases' sum, NaN counted 0)
    for refs in (exact, sketched):
        got = np.stack([refs.median_of_others("own", step_refs.series_of(ds[r], steps)["own"]) for r in range(n_ranks)])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            np.testing.assert_allclose(refs.median("forward"), np.nanmedian(m.astype(np.float32), axis=0), atol=1e-7)


def test_sketched_median_of_2000_ranks_is_within_klls_rank_error():
    rng = np.random.default_rng(0)
    m = rng.lognormal(-1.2, 0.3, size=(2000, 6))
    m[17] += 5.0  # a straggler: far above any median
    ds = {r: digest(r, m[r]) for r in range(2000)}
    parts = [sketches.leaf([ds[r] for r in range(i, i + 100)]) for i in range(0, 2000, 100)]
    refs = sketches.refs(sketches.merged(parts))
    med = refs.median("own")
    rank_of = (np.sort(m.astype(np.float32), axis=0) < med.astype(np.float32)).mean(axis=0)
    assert np.all(np.abs(rank_of - 0.5) < 0.03), rank_of  # (KLL k=200: ~1.65% normalized rank error)
    excess = step_refs.series_of(ds[17], np.arange(6))["own"] - refs.median_of_others("own", m[17])
    assert np.all(excess > 4.5)


def test_buckets_keep_each_buckets_extremes_and_line_up_across_widths():
    steps = np.arange(0, 1000)
    v = np.sin(steps / 30.0)
    v[555] = 50.0  # a spike: kept
    v[700] = np.nan
    b = Buckets.of(steps, {"x": v}, width_for(999))
    assert b.width == 4 and len(b.index) == 250
    coarse = b.coarsened(16)
    ref = Buckets.of(steps, {"x": v}, 16)
    for field in ("lo", "hi", "total", "finite", "nonfinite"):
        np.testing.assert_allclose(getattr(coarse, field)["x"], getattr(ref, field)["x"], rtol=1e-6)
    assert coarse.hi["x"].max() == 50.0 and coarse.nonfinite["x"][700 // 16]
    short = Buckets.of(steps[:300], {"x": v[:300]}, width_for(299))  # a rank that stopped early: narrower
    ranks, edges, lo, hi, mean, nonfinite, missing = side_by_side({0: b, 1: short}, "x")
    assert ranks == [0, 1] and edges[1] - edges[0] == 4 and missing[1, -1] and not missing[1, 0]
    np.testing.assert_allclose(hi[1, :75], hi[0, :75])


def test_a_light_is_bounded_whatever_the_steps_and_holds_what_the_findings_need_exactly():
    sizes = {}
    for n in (10_000, 100_000):
        d = digest(0, np.full(n, 0.1))
        d.buckets = Buckets.of(d.steps, {"own": d.own_s, "loss": d.loss}, width_for(n - 1))
        lt = light(d, finding_steps=[5_000], peak_steps=[7_000])
        sizes[n] = len(pickle.dumps(lt))
        w = lt.near[5_000]
        np.testing.assert_array_equal(w["loss"], d.loss[4_980:5_001])
        assert w["i"] == 5_000 and lt.peaks[7_000] == peak_by(d, 7_000) == d.memory[:7_001].max()
        assert near_at(d, n + 5) is None and lt.last_time == d.time_unix[-1] and lt.end_time == d.time_unix[-1]
    assert sizes[100_000] < 1.25 * sizes[10_000] < 60_000, sizes  # (313 and 391 buckets)
