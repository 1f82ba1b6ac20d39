"""attention_collapse: per head of the collapsed layer, the statistic that collapsed (entropy,
share on one key, or how alike the heads are), over the sampled steps."""

from __future__ import annotations

import warnings

import numpy as np

from ...analyzer.detectors import attention_collapse
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import name, names, step, text

KIND = "attention_collapse"
# What collapsed, as the verdict says it: (before the layer's name, after it).
_HOW = {"entropy": ("the attention entropy of ", " collapsed"),
        "sink": ("every head of ", " put its attention on a single key"),
        "alike": ("the heads of ", " all computed the same sharp pattern")}


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    if len(fs) == 1:
        ev: attention_collapse.Evidence = f.evidence
        before, after = _HOW.get(ev.get("collapse"), ("the attention of ", " collapsed"))
        return text(before, name(f.where[0] if f.where else ""), f"{after} from {step(f.step)}")
    return text("the attention of ", names([w for g in fs for w in g.where]),
                f" collapsed from {step(min(g.step for g in fs))}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Attention heads", f.rank)
    sites = rt.attention_sites
    module = f.where[0] if f.where else None
    rows = [i for i, m in enumerate(sites["module"]) if m == module] if len(sites) else []
    if not rows:
        return no_figure(title, "No attention statistics were recorded for this layer.")
    j = rows[0]
    site = sites.iloc[j]
    heads = list(range(int(site["head_offset"]), int(site["head_offset"] + site["heads"])))
    ev: attention_collapse.Evidence = f.evidence
    how = ev.get("collapse", "entropy")
    cfg = ctx.cfg.attention_collapse
    span = ctx.span(rt)
    label = module or "(model)"
    if how == "alike":
        sim = ctx.attention(rt, "head_similarity")
        ent = ctx.attention(rt, "entropy")
        if sim is None or ent is None:
            return no_figure(title, "No attention statistics were recorded.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_ent = np.nanmean(ent.iloc[:, heads].to_numpy(dtype=float), axis=1)
        x = sim.index.to_numpy()
        lines = [plots.Line("similarity of the heads", x, sim.iloc[:, j].to_numpy(dtype=float), emphasis=True),
                 plots.Line("mean entropy of the heads", x, mean_ent, emphasis=True)]
        hlines = [(cfg.similarity, f"similarity threshold {cfg.similarity:g}", "#c62828", "--"),
                  (cfg.alike_entropy, f"sharp below {cfg.alike_entropy:g}", "#ef6c00", ":")]
        caption = (f"Mean pairwise cosine similarity of the attention maps of the {len(heads)} heads of "
                   f"{label}, and their mean normalised entropy, at each sampled step. Heads that are "
                   f"alike and sharp compute one pattern {len(heads)} times.")
        ylabel = "similarity / entropy"
    else:
        stat, ylabel, thr, what = (("sink_share", "share of mass on one key", cfg.sink_share,
                                    "the share of its attention on its single most-attended key")
                                   if how == "sink" else
                                   ("entropy", "normalised entropy", cfg.entropy,
                                    "the mean normalised entropy of its attention rows (1: uniform, 0: one-hot)"))
        data = ctx.attention(rt, stat)
        if data is None:
            return no_figure(title, "No attention statistics were recorded.")
        x = data.index.to_numpy()
        lines = [plots.Line(f"head {h}", x, data.iloc[:, c].to_numpy(dtype=float)) for h, c in enumerate(heads)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = np.nanmean(data.iloc[:, heads].to_numpy(dtype=float), axis=1)
        lines.append(plots.Line("mean of the heads", x, mean, color="black", width=1.8))
        hlines = [(thr, f"threshold {thr:g}", "#c62828", "--")]
        caption = f"For each of the {len(heads)} heads of {label}, {what}, at each sampled step."
    caption += f" The dotted line marks {step(f.step)}."
    return figure(title, caption, plots.plot_lines, lines, ylabel=ylabel, hlines=hlines,
                  marks=ctx.marks(only=f), xspan=span, ylim=(-0.03, 1.05))
