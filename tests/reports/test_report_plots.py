"""Plot helpers: downsampling keeps spikes and gaps; bad numbers never break a figure."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

from torchautopsy.reports import diff_figures, layer_plots, plot_layout, plots


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


def _ink(png: bytes) -> np.ndarray:
    """Where a PNG is not white: a boolean (rows, columns) mask."""
    from matplotlib.image import imread
    import io

    rgb = imread(io.BytesIO(png))[..., :3]
    return (rgb < 0.97).any(axis=-1)


def test_every_label_legend_and_colorbar_is_inside_the_figure_and_the_figure_is_used():
    """The margins are measured (plot_layout.fit_margins): nothing is cut at an edge, whatever sits
    outside the axes (a legend of long names on the right, a twin axis, a legend below, a
    colorbar, long row labels), and no edge is left empty."""
    steps = np.arange(200)
    long = [plots.Line("encoder.layers.11.self_attention.query_key_value.weight" + str(i), steps,
                       np.exp(-steps / (20 + i)) * 1e-3) for i in range(6)]
    census = (np.array([10, 90, 170]), np.array([100, 180, 260]), np.array([0, 80, 160]))
    events = [("exploding_gradients · " + "transformer.h.0.mlp.c_fc" * 3, 41, "error", "D"),
              ("nonfinite", 56, "error", "s")]
    figures = {
        "log lines, legend outside": plots.render_png(plots.plot_lines, long, log=True, ylabel="grad norm"),
        "twin axis, legend below": plots.render_png(
            plots.plot_memory, {"resident (RSS)": (steps, 300 + 2.0 * steps)}, census=census),
        "heatmap and colorbar": plots.render_png(
            layer_plots.plot_heatmap, np.random.default_rng(0).normal(size=(3, 50)),
            ["conv1.weight", "a_long_module_name.with.parts.weight", "fc.weight"], np.arange(51.0),
            cbar_label="log10 gradient L2 norm"),
        "timeline of long names": plots.render_png(plots.plot_timeline, events, xspan=(0, 100), height_in=1.2),
        "a shrunk colorbar (diff's heatmap)": plots.render_png(
            diff_figures._draw_heat, np.arange(0, 101, 10.0), ["conv1.weight", "fc.bias"],
            np.random.default_rng(0).normal(size=(10, 2)), [], height_in=1.5),
    }
    for what, png in figures.items():
        ink = _ink(png)
        assert not (ink[:2].any() or ink[-2:].any() or ink[:, :2].any() or ink[:, -2:].any()), what
        rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
        margin = plot_layout.PAD_IN * plots.DPI * 3  # a few pixels beyond the pad, at most
        assert rows[0] < margin and cols[0] < margin, what
        assert ink.shape[0] - rows[-1] < margin and ink.shape[1] - cols[-1] < margin, what


def test_log_axes_are_labelled_in_plain_text():
    """Log and symlog ticks read 10⁻³, 2×10⁻³, −10⁻³: matplotlib's own labels without its mathtext
    (parsed by pyparsing, a large part of drawing a report)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def labels(scale: str, lo: float, hi: float, **kw) -> list[str]:
        fig = Figure()
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.set_yscale(scale, **kw)
        ax.set_ylim(lo, hi)
        plot_layout.plain_log_labels(fig)
        fig.canvas.draw()
        return [t.get_text() for t in ax.get_yticklabels() + ax.yaxis.get_minorticklabels() if t.get_text()]

    wide = labels("log", 1e-6, 1.0)
    assert "10⁻⁶" in wide and "10⁻³" in wide and "10⁰" in wide, wide
    narrow = labels("log", 1.5e-3, 4e-3)  # less than a decade: matplotlib labels the minor ticks
    assert "2×10⁻³" in narrow and "3×10⁻³" in narrow, narrow
    both = labels("symlog", -1e-2, 1e-2, linthresh=1e-4)
    assert "−10⁻²" in both and "0" in both and "10⁻²" in both, both
    assert not [t for t in wide + narrow + both if "$" in t or "\\" in t]
