"""vanishing_gradients: the gradient RMS of each weight tensor in definition order (depth), over
the window the detector judged: the early third against the last third."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import vanishing_gradients
from ...analyzer.findings import Finding
from ...analyzer.trace.gradients import median_grad_rms, weight_tensors
from .. import layer_plots, plots
from ..context import Context, figure, no_figure, read_or_none
from ..model import Figure, Text
from ._text import name, num, step, text

KIND = "vanishing_gradients"
# Bars beyond this many cannot carry a name each: the axis then counts them.
MAX_BARS = 400


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: vanishing_gradients.Evidence = f.evidence
    r = ev.get("early_to_late_rms_ratio")
    where = f.where[0] if f.where else None
    if isinstance(r, (int, float)) and r > 0:
        return text("gradients of the early layers", text(" (", name(where), ")") if where else "",
                    f" were {num(1 / r)}x smaller than the last layers' from {step(f.step)}")
    return text(f"gradients were near zero from {step(f.step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Gradient RMS by depth", f.rank)
    weights = weight_tensors(rt)
    ev: vanishing_gradients.Evidence = f.evidence
    win = ev.get("window_steps") or [int(rt.step_index[0]), int(rt.step_index[-1])]
    # The judged window's per-tensor median, as the detector takes it.
    span = rt.rows_in_span(win[0], win[-1])
    med = read_or_none(lambda: median_grad_rms(rt, np.arange(span.start, span.stop), weights)) \
        if rt.n_steps and len(weights) >= 2 else None
    if med is None:
        return no_figure(title, "Fewer than two weight tensors have gradients recorded.")
    if not (med > 0).any():
        return _all_zero(ctx, f, rt, ctx.param(rt, "grad_norm"), weights, win)
    names = [rt.param_names[j] for j in weights]
    third = max(1, len(weights) // 3)
    groups = ["early third (judged)" if i < third else "last third (reference)" if i >= len(weights) - third
              else "middle" for i in range(len(weights))]
    late = med[len(weights) - third:]
    hlines = []
    ratio = ctx.cfg.vanishing_gradients.ratio
    if np.isfinite(late).any():
        late_med = float(np.nanmedian(late))
        hlines = [(late_med, "median of the last third", "#2e7d32", "--"),
                  (late_med * ratio, f"threshold: {ratio:g}x that", "#c62828", "--")]
    cut = ""
    if len(names) > MAX_BARS:  # keep both ends: the comparison is early against late
        keep = list(range(MAX_BARS // 2)) + list(range(len(names) - MAX_BARS // 2, len(names)))
        cut = f" Only the first and last {MAX_BARS // 2} of {len(names):,} weight tensors are drawn."
        names, med, groups = [names[i] for i in keep], med[keep], [groups[i] for i in keep]
    caption = (f"Median gradient RMS (L2 norm / sqrt(elements)) of each weight tensor over steps "
               f"{win[0]:,}-{win[-1]:,}, in definition order (input side left), log scale. The "
               f"detector compares the smallest of the early third with the median of the last "
               f"third: below the red line, the early layers barely learn.{cut}")
    colors = {"early third (judged)": "#1565c0", "middle": "#b0bec5", "last third (reference)": "#43a047"}
    return figure(title, caption, layer_plots.plot_profile, names, med, groups, ylabel="gradient RMS",
                  hlines=hlines, group_colors=colors, height_in=3.2)


def _all_zero(ctx: Context, f: Finding, rt, g, weights, win) -> Figure:
    """Every weight gradient is zero in the judged window: show, over steps, which parameters
    (biases included) still get a gradient, and when the others stopped."""
    title = ctx.title_rank("Gradient norm per parameter", f.rank)
    drawn = plots.largest_columns(g, plots.MAX_LINES)
    if not drawn:
        return no_figure(title, "Every parameter's gradient is exactly zero at every recorded step: "
                                "no line to draw on a log scale (the overview's heatmap is grey throughout).")
    x = g.index.to_numpy()
    lines = [plots.Line(n, x, g[n].to_numpy(dtype=float), emphasis=True) for n in drawn]
    total = rt.total_grad_norm
    lines.append(plots.Line("total (all gradients)", total.index.to_numpy(), total.to_numpy(),
                            color="black", style="--", width=1.3))
    never = [rt.param_names[j] for j in weights if rt.param_names[j] not in drawn]
    caption = (f"L2 norm of the gradient of each parameter that ever had a non-zero one, per step, log "
               f"scale. Every weight tensor's gradient is exactly zero over steps {win[0]:,}-{win[-1]:,}: "
               f"a line ends where its gradient became zero.")
    if never:
        caption += (f" Zero at every step, so not drawn: {', '.join(never[:6])}"
                    f"{' …' if len(never) > 6 else ''}.")
    caption += f" The dotted line marks {step(f.step)}."
    return figure(title, caption, plots.plot_lines, lines, log=True, ylabel="gradient L2 norm",
                  marks=ctx.marks(only=f), xspan=ctx.span(rt))
