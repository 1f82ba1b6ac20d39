"""out_of_memory: memory over the steps before it ran out, with the step it ran out at marked."""

from __future__ import annotations

import numpy as np

from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import step, text

KIND = "out_of_memory"
MIB = 2**20


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    device = f.evidence.get("device", "the device")
    return text(f"memory ran out on {device} at {step(f.step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Memory before it ran out", f.rank)
    df = rt.steps
    if not len(df):
        return no_figure(title, "No step was recorded before memory ran out.")
    x = df.index.to_numpy()
    cuda = str(f.evidence.get("device", "")).startswith("cuda") and bool((df["cuda_allocated_bytes"] >= 0).all())
    cols = (("cuda_allocated_bytes", "CUDA allocated"), ("cuda_reserved_bytes", "CUDA reserved")) if cuda \
        else (("rss_bytes", "resident memory (RSS)"),)
    series = {}
    for c, label in cols:
        y = df[c].to_numpy(dtype=float)
        series[label] = (x, np.where(y >= 0, y / MIB, np.nan))
    caption = (f"{' and '.join(label for _, label in cols)} at the end of each recorded step, in MiB; the "
               f"dotted line marks {step(f.step)}, the step that ran out of memory (it never reached "
               f"rec.step(), so it has no point of its own).")
    span = (float(x[0]), float(max(x[-1], f.step or x[-1]))) if len(x) > 1 else None
    return figure(title, caption, plots.plot_memory, series, marks=ctx.marks(only=f), xspan=span)
