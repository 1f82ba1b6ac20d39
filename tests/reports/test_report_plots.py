"""Plot helpers: downsampling keeps spikes and gaps; bad numbers never break a figure."""

from __future__ import annotations

import base64

import numpy as np
import pandas as pd
import pytest

from torchautopsy.reports import plots


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
    steps = pd.Index(np.arange(6), name="step")
    grad = pd.DataFrame({"w$\\alpha$": [1.0, np.inf, np.nan, 0.0, -1.0, 1e30],
                         "dead": [np.nan] * 6}, index=steps)
    total = pd.Series([np.nan, np.inf, 1.0, 2.0, np.nan, np.nan], index=steps)
    loss = pd.Series([np.nan] * 6, index=steps)
    for uri in (
        plots.png_data_uri(plots.plot_grad_norms, grad, total=total, marks=[(2, "error", "nonfinite")]),
        plots.png_data_uri(plots.plot_grad_norms, grad.iloc[:0], total=None),
        plots.png_data_uri(plots.plot_loss, {"loss": loss}, marks=[(1, "warning", "x")]),
    ):
        assert uri.startswith("data:image/png;base64,")
        assert base64.b64decode(uri.split(",", 1)[1]).startswith(b"\x89PNG")


def test_labels_are_shortened_and_never_mathtext():
    assert plots.shorten("$x$") == r"\$x\$"
    long = "encoder.layers." + "9" * 60 + ".self_attn.out_proj.weight"
    short = plots.shorten(long, 40)
    assert len(short) == 40 and short.startswith("encoder.") and short.endswith("proj.weight")
