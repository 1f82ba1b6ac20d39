"""Plot helpers: downsampling keeps spikes and gaps; bad numbers never break a figure."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

from torchautopsy.reports import layer_plots, plots


def test_downsample_keeps_spikes_and_gaps():
    n = 100_000
    x = np.arange(n)
    y = np.ones(n)
    y[54_321] = 1e6        # one spike
    y[77_777] = -5.0       # one dip
    y[10_000:20_000] = np.nan  # a long gap
    xs, ys = plots.downsample_minmax(x, y, max_points=2000)
    assert len(xs) <= 2000
    assert np.all(np.diff(xs) > 0)
    assert 54_321 in xs and 1e6 in ys
    assert 77_777 in xs and -5.0 in ys
    gap = (xs >= 10_000) & (xs < 20_000)
    assert gap.any() and np.isnan(ys[gap]).all()


def test_a_million_steps_downsample_fast_and_keep_every_bucket_extreme():
    rng = np.random.default_rng(0)
    n = 1_000_000
    y = rng.normal(size=n)
    spikes = np.arange(50) * 19_997 + 7  # one per bucket of 1,000 steps at most
    y[spikes] = 100.0
    t = time.perf_counter()
    xs, ys = plots.downsample_minmax(np.arange(n), y)
    assert time.perf_counter() - t < 2.0
    assert len(xs) <= plots.MAX_POINTS
    assert set(spikes) <= set(xs.tolist())
    assert ys.min() == y.min()


def test_short_series_are_left_alone():
    x, y = np.arange(10), np.linspace(0, 1, 10)
    xs, ys = plots.downsample_minmax(x, y)
    assert np.array_equal(xs, x) and np.array_equal(ys, y)


def test_largest_columns_keeps_order_and_skips_empty_ones():
    df = pd.DataFrame({"a": [1.0, 2.0], "b": [np.nan, np.inf], "c": [50.0, 0.0], "d": [3.0, np.nan],
                       "e": [0.0, 0.0]})
    assert plots.largest_columns(df, 2) == ["c", "d"]
    assert plots.largest_columns(df, 10) == ["a", "c", "d"]
    assert plots.largest_columns(df, 2, keep=["a", "b"]) == ["a", "c"]  # b has nothing to draw


@pytest.mark.filterwarnings("error")
def test_nonfinite_and_empty_data_still_draw():
    steps = np.arange(6)
    lines = [plots.Line("w$\\alpha$", steps, np.array([1.0, np.inf, np.nan, 0.0, -1.0, 1e30]), emphasis=True),
             plots.Line("dead", steps, np.full(6, np.nan))]
    loss = pd.Series([np.nan] * 6, index=pd.Index(steps, name="step"))
    for png in (
        plots.render_png(plots.plot_lines, lines, log=True, marks=[(2, "error", "nonfinite", "D")],
                         nonfinite_at=[(1.0, "w")]),
        plots.render_png(plots.plot_lines, [], log=True),
        plots.render_png(plots.plot_loss, {"loss": loss}, marks=[(1, "warning", "x", "o")]),
        plots.render_png(layer_plots.plot_heatmap, np.full((2, 3), np.nan), ["a", "b"], np.arange(4.0),
                         nonfinite=np.eye(2, 3, dtype=bool)),
        plots.render_png(plots.plot_stacked, steps, {"a": np.full(6, np.nan), "b": np.ones(6)}, ylabel="ms"),
    ):
        assert png.startswith(b"\x89PNG")
    assert plots.png_data_uri(b"\x89PNG").startswith("data:image/png;base64,")


def test_labels_are_shortened_and_never_mathtext():
    assert plots.shorten("$x$") == r"\$x\$"
    long = "encoder.layers." + "9" * 60 + ".self_attn.out_proj.weight"
    short = plots.shorten(long, 40)
    assert len(short) == 40 and short.startswith("encoder.") and short.endswith("proj.weight")
