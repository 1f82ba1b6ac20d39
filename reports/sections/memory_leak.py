"""memory_leak: memory over steps with the fitted straight line, and the live-tensor census."""

from __future__ import annotations

import numpy as np

from ...analyzer.detectors import memory_leak
from ...analyzer.findings import Finding
from .. import plots
from ..context import Context, figure, no_figure
from ..model import Figure, Text
from ._text import step, text

KIND = "memory_leak"
MIB = 2**20
SERIES = {"rss_bytes": "resident memory (RSS)", "cuda_allocated_bytes": "CUDA allocated",
          "cuda_reserved_bytes": "CUDA reserved"}


def per_step(bytes_per_step: float) -> str:
    mib = bytes_per_step / MIB
    return f"{mib:.2f} MiB" if abs(mib) >= 0.01 else f"{bytes_per_step / 1024:.1f} KiB"


def phrase(fs: list[Finding]) -> Text:
    f = fs[0]
    ev: memory_leak.Evidence = f.evidence
    slope = ev.get("bytes_per_step")
    series = SERIES.get(ev.get("series"), "memory")
    grew = f"grew by {per_step(slope)} per step" if isinstance(slope, (int, float)) else "grew steadily"
    return text(f"{series} {grew} from {step(f.step)}")


def figure_for(ctx: Context, f: Finding) -> Figure:
    rt = ctx.rank(f.rank)
    title = ctx.title_rank("Memory over steps", f.rank)
    df = rt.columns
    ev: memory_leak.Evidence = f.evidence
    col = ev.get("series", "rss_bytes")
    if col not in df.columns:
        return no_figure(title, f"The trace holds no {col}.")
    x = df.index.to_numpy()
    series = {}
    for c in (col, "cuda_reserved_bytes") if col == "cuda_allocated_bytes" else (col,):
        y = df[c].to_numpy(dtype=float)
        series[SERIES.get(c, c)] = (x, np.where(y >= 0, y / MIB, np.nan))
    fit = None
    slope, span = ev.get("bytes_per_step"), ev.get("steps_analysed")
    if isinstance(slope, (int, float)) and span and len(span) == 2:
        sel = (x >= span[0]) & (x <= span[1])
        y = df[col].to_numpy(dtype=float)[sel]
        ok = np.isfinite(y) & (y >= 0)
        if ok.any():
            intercept = float(np.mean(y[ok] - slope * x[sel][ok]))
            xs = np.array([span[0], span[1]], dtype=float)
            r2 = ev.get("r2")
            label = f"fit: {per_step(slope)}/step" + (f", R² {r2:.2f}" if isinstance(r2, (int, float)) else "")
            fit = plots.Line(label, xs, (slope * xs + intercept) / MIB, color="#c62828", style="--", width=1.6)
    n = df["live_tensors"].to_numpy(dtype=float)
    sel = n >= 0
    census = (x[sel], n[sel], df["live_tensors_with_graph"].to_numpy(dtype=float)[sel]) if sel.sum() >= 2 else None
    label = SERIES.get(col, col)
    caption = (f"{label[0].upper() + label[1:]} per step, in MiB, with the straight line fitted over "
               f"the steps the detector analysed (after warm-up)")
    caption += ("; markers (right axis): the recorder's census of live tensors, and of those holding an "
                "autograd graph. " if census is not None else ". ")
    caption += f"The dotted line marks {step(f.step)}, where the growth began."
    return figure(title, caption, plots.plot_memory, series, fit=fit, census=census,
                  marks=ctx.marks(only=f), xspan=ctx.span(rt))
