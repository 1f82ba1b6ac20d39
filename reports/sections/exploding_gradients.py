"""exploding_gradients: the gradient norm of each layer over steps, the early baseline, the
threshold, and the step it was crossed."""

from __future__ import annotations

from ...analyzer.detectors import exploding_gradients
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, first_nonfinite, no_figure, rows_between, undrawn
from ..model import Figure, Text
from ._text import names, num, step, text

KIND = "exploding_gradients"
TITLE = "Gradient norm per layer"


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: exploding_gradients.Evidence = f.evidence
    where = text(" (fastest growth in ", names(f.where), ")") if f.where else ()
    # Each variant of the finding says what its evidence holds (no "?x" for a missing number).
    if "early_to_late_rms_ratio" in ev:
        return text(f"from {step(f.step)}, early layers' gradients {num(ev['early_to_late_rms_ratio'])}x the "
                    f"late layers'", where)
    if "activation_growth" in ev:
        return text(f"from {step(f.step)}, activations growing {num(ev['activation_growth'])}x through depth",
                    where)
    if "ratio_at_step" not in ev:
        return text(f"gradients exploding from {step(f.step)}", where)
    how = "exploded" if f.severity == "error" else "jumped"
    return text(f"gradients {how} from {step(f.step)}, to {num(ev.get('ratio_at_step'))}x their early norm",
                where)


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank(TITLE, f.rank)
    span, note = ctx.window(rt, f.step)
    g = ctx.param(rt, "grad_norm", span)
    if g is None or rt.n_steps == 0:
        return no_figure(title, "No gradient norms were recorded.")
    cols = list(dict.fromkeys([w for w in f.where if w in g.columns] + ctx.weights(rt)))
    frame = rows_between(g[cols], span)
    drawn = plots.largest_columns(frame, plots.MAX_LINES, keep=f.where)
    total = rows_between(rt.total_grad_norm.to_frame(), span).iloc[:, 0]
    lines = [plots.Line(n, frame.index.to_numpy(), frame[n].to_numpy(), emphasis=n in f.where) for n in drawn]
    lines.append(plots.Line("total (all gradients)", total.index.to_numpy(), total.to_numpy(),
                            color="black", style="--", width=1.3))
    ev: exploding_gradients.Evidence = f.evidence
    hlines = []
    base, ratio = ev.get("baseline_total_grad_norm"), ev.get("threshold_ratio")
    if isinstance(base, (int, float)) and base > 0:
        hlines.append((float(base), "early baseline (total)", "#616161", "-."))
        if isinstance(ratio, (int, float)):
            hlines.append((float(base) * ratio, f"threshold: {ratio:g}x baseline", "#c62828", "--"))
    bad = ctx.param(rt, "grad_nonfinite", span)
    crosses = first_nonfinite(rows_between(bad, span)[drawn].where(lambda d: d <= 0, float("nan")), drawn) \
        if bad is not None and drawn else []
    caption = (f"L2 norm of the gradient of each weight tensor per step, log scale: thick, the "
               f"parameters the finding names; thin, the {len([d for d in drawn if d not in f.where])} largest "
               f"others; dashed black, all gradients together; dash-dot grey, the early baseline; red "
               f"dashed, the threshold. The dotted line marks {step(f.step)}; red crosses on the top "
               f"edge mark where a parameter's gradient first held NaN/Inf (lines stop there).{note}")
    left = len(cols) - len(drawn) - len([w for w in f.where if w in cols and w not in drawn])
    if left > 0:
        caption += f" {left:,} other weight tensors are not drawn."
    caption += undrawn(f.where, drawn)
    return figure(title, caption, plots.plot_lines, lines, log=True, ylabel="gradient L2 norm",
                  hlines=hlines, marks=ctx.marks(only=f), xspan=span, nonfinite_at=crosses,
                  height_in=3.0)
