"""The streaming reads (blocks, chosen rows, the per-step digest, buckets) give exactly what whole
reads give, on a trace long enough to span several blocks, written by the recorder's own writer."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from torchautopsy.analyzer.trace import block_rows, load
from tests.helpers import REPO, invoke_cli

STEPS, PARAMS, MODULES, EXPLODE_AT = 50_000, 200, 20, 45_000


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "synthetic_trace.py"), str(out),
                    "--steps", str(STEPS), "--params", str(PARAMS), "--modules", str(MODULES),
                    "--explode-at", str(EXPLODE_AT)], check=True, capture_output=True)
    return out


def full(rt, name):
    import h5py

    with h5py.File(rt.path, "r") as f:
        return f[name][()]


def test_blocks_cover_the_table_in_several_pieces(long_trace):
    rt = load(long_trace).ranks[0]
    pieces = list(rt.blocks("params/grad_norm"))
    assert len(pieces) >= 2 and block_rows(PARAMS) < STEPS
    assert [a for a, _ in pieces] == list(range(0, STEPS, block_rows(PARAMS)))
    np.testing.assert_array_equal(np.concatenate([b for _, b in pieces]), full(rt, "params/grad_norm"))
    tail = list(rt.blocks("params/grad_norm", start=STEPS - 10))
    assert len(tail) == 1 and tail[0][0] == STEPS - 10 and len(tail[0][1]) == 10


def test_chosen_rows_match_a_whole_read(long_trace):
    rt = load(long_trace).ranks[0]
    g = full(rt, "params/grad_norm")
    rng = np.random.default_rng(0)
    rows = rng.choice(STEPS, 500, replace=False)  # unsorted, spread over every block
    frame = rt.param_stat("grad_norm", rows=rows)
    np.testing.assert_array_equal(frame.to_numpy(), g[np.sort(rows)])
    assert frame.index.tolist() == sorted(rows.tolist())  # steps are 0..n-1 here
    assert frame.columns.tolist() == rt.param_names
    np.testing.assert_array_equal(rt.param_stat("grad_norm", rows=[-1]).to_numpy(), g[-1:])
    np.testing.assert_array_equal(rt.param_stat("grad_norm", rows=slice(7, None, 3)).to_numpy(), g[7::3])
    np.testing.assert_array_equal(rt.param_stat("grad_norm", rows=slice(-5, None)).to_numpy(), g[-5:])
    u = full(rt, "updates/ratio")
    np.testing.assert_array_equal(rt.update_ratio(rows=slice(3, None, 7)).to_numpy(), u[3::7])
    with pytest.raises(IndexError):
        rt.param_stat("grad_norm", rows=[STEPS])


def test_digest_matches_whole_reads(long_trace):
    rt = load(long_trace).ranks[0]
    g = full(rt, "params/grad_norm").astype(np.float64)
    bad = full(rt, "params/grad_nonfinite") > 0
    w = full(rt, "params/param_norm")
    present = ~np.isnan(g) | bad
    with np.errstate(invalid="ignore"):
        tot = np.sqrt(np.where(present, g * g, 0.0).sum(axis=1))
    tot[~present.any(axis=1)] = np.nan
    d = rt.digest
    np.testing.assert_allclose(d.total_grad_norm, tot, rtol=1e-12)
    np.testing.assert_array_equal(d.grad_nonfinite, bad.any(axis=1))
    np.testing.assert_array_equal(d.param_nonfinite, ~np.isfinite(w).all(axis=1))
    np.testing.assert_array_equal(d.grad_absent, ~present.any(axis=1))
    # The synthetic run breaks 300 steps after the explosion starts: the digest sees it.
    assert int(np.flatnonzero(d.grad_nonfinite)[0]) == EXPLODE_AT + 300
    # vanishing_gradients' per-step ratio, made in the same pass: the first third of the weight
    # tensors' smallest gradient RMS over the last third's median, as from the whole table.
    weights = [j for j, shape in enumerate(rt.param_shapes) if len(shape) >= 2]
    third = max(1, len(weights) // 3)
    assert len(weights) >= 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (all-NaN rows after the run broke)
        rms = g[:, weights] / np.sqrt(rt.param_numel[weights].astype(np.float64))
        rms[~np.isfinite(rms)] = np.nan
        ratio = np.nanmin(rms[:, :third], axis=1) / np.nanmedian(rms[:, -third:], axis=1)
    np.testing.assert_array_equal(d.early_to_late, ratio)
    np.testing.assert_array_equal(d.weight_grads, ~np.isnan(rms).all(axis=1))


def test_buckets_match_numpy_on_the_whole_table(long_trace):
    rt = load(long_trace).ranks[0]
    g = full(rt, "params/grad_norm").astype(np.float64)
    cols = [0, 5, 199]
    edges = np.array([100, 101, 20_000, 20_971, 20_972, 41_000, 49_999])  # straddling block ends
    b = rt.bucketed("params/grad_norm", edges, cols)
    v = g[:, cols]
    for k in range(len(edges) - 1):
        part = v[edges[k]:edges[k + 1]]
        fin = np.where(np.isfinite(part), part, np.nan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
            np.testing.assert_array_equal(b["max"][k], np.nanmax(fin, axis=0))
            np.testing.assert_array_equal(b["min"][k], np.nanmin(fin, axis=0))
            np.testing.assert_array_equal(b["positive_max"][k], np.nanmax(np.where(fin > 0, fin, np.nan), axis=0))
        np.testing.assert_array_equal(b["nonfinite"][k], ~np.isfinite(part).all(axis=0))
        np.testing.assert_array_equal(b["inf"][k], np.isinf(part).any(axis=0))
    assert b["nonfinite"][-1].all()  # the last bucket lies after the run went NaN


def test_activity_windows_stream_every_window(long_trace):
    rt = load(long_trace).ranks[0]
    windows = list(rt.activity_windows())
    starts = full(rt, "activity/step_start")
    assert len(windows) == len(starts) > 2 * 256  # (windows of 50 steps after the first four)
    assert [w[0] for w in windows] == starts.tolist()
    n_bits = int((rt.activity_sites["bit_offset"] + rt.activity_sites["units"]).max())
    packed = full(rt, "activity/ever_positive")
    for i in (0, 255, 256, len(windows) - 1):  # either side of a block of windows
        bits = np.unpackbits(packed[i], bitorder="little")[:n_bits].astype(bool)
        np.testing.assert_array_equal(windows[i][3], bits)


def test_cli_finds_the_explosion_in_the_long_trace(long_trace, tmp_path):
    out = tmp_path / "f.json"
    r = invoke_cli("analyze", long_trace, "--json", out, "--html", tmp_path / "r.html")
    assert r.returncode == 0, r.stderr
    found = {f["kind"]: f for f in json.loads(out.read_text())["findings"]}
    assert found["nonfinite"]["step"] == EXPLODE_AT + 300
    assert EXPLODE_AT < found["exploding_gradients"]["step"] < EXPLODE_AT + 300
    assert found["exploding_gradients"]["severity"] == "error"
    assert not any(f["severity"] != "info" for k, f in found.items()
                   if k not in ("nonfinite", "exploding_gradients", "loss_divergence"))
