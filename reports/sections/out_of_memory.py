"""out_of_memory: memory over the steps before it ran out, with the step it ran out at marked."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import out_of_memory
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import step, text

KIND = "out_of_memory"
MIB = 2**20


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: out_of_memory.Evidence = f.evidence
    device = ev.get("device", "the device")
    return text(f"memory ran out on {device} at {step(f.step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Memory before it ran out", f.rank)
    df = rt.columns
    if not len(df):
        return no_figure(title, "No step was recorded before memory ran out.")
    x = df.index.to_numpy()
    ev: out_of_memory.Evidence = f.evidence
    cuda = str(ev.get("device", "")).startswith("cuda") and bool((df["cuda_allocated_bytes"] >= 0).all())
    cols = (("cuda_allocated_bytes", "CUDA allocated"), ("cuda_reserved_bytes", "CUDA reserved")) if cuda \
        else (("rss_bytes", "resident memory (RSS)"),)
    # What the process held when the allocation failed (read by the recorder at the failure), as
    # the last point of each line: the steps' records alone stop before the failing step.
    at_failure = {"rss_bytes": "rss_bytes", "cuda_allocated_bytes": "device_allocated_bytes",
                  "cuda_reserved_bytes": "device_reserved_bytes"}
    series, extended = {}, False
    for c, label in cols:
        y = df[c].to_numpy(dtype=float)
        xs, ys = x, np.where(y >= 0, y / MIB, np.nan)
        held = ev.get(at_failure[c])
        if isinstance(held, (int, float)) and held >= 0 and f.step is not None and f.step > x[-1]:
            xs, ys = np.append(xs, f.step), np.append(ys, held / MIB)
            extended = True
        series[label] = (xs, ys)
    labels = " and ".join(label for _, label in cols)
    if extended:
        caption = (f"{labels[0].upper() + labels[1:]} at the end of each recorded step, in MiB, and, as the last "
                   f"point, at {step(f.step)} when the allocation failed (that step never reached rec.step()); "
                   "the dotted line marks that step.")
    else:
        caption = (f"{labels[0].upper() + labels[1:]} at the end of each recorded step, in MiB; the dotted line "
                   f"marks {step(f.step)}, the step that ran out of memory (it never reached rec.step(), so it "
                   "has no point of its own).")
    span = (float(x[0]), float(max(x[-1], f.step or x[-1]))) if len(x) > 1 else None
    return figure(title, caption, plots.plot_memory, series, marks=ctx.marks(only=f), xspan=span)
