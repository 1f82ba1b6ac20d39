"""Which HDF5 filter should the trace's per-step tables use? Bytes per step and write cost of
each, with the recorder's own write pattern.

    python benchmarks/trace_filters.py [--steps 3000] [--flush-every 50] [--params 200]

The recorder appends rows to chunked datasets in an SWMR file and flushes every few seconds (a
job killed by SIGKILL loses at most that much), so the last, partly filled chunk of a dataset is
written again at every flush. This script replays that pattern: per step one row of the real
per-step tables (a parameter-norm table `--params` wide, float32, and a few scalar columns),
with a write and a flush every `--flush-every` steps (a 50 ms step flushed every 5 s is every
100 steps; a fast 5 ms step, every 1,000), into a fresh file per filter. The values are real:
they cycle through the gradient and weight norms of the shipped sample traces, as the recorder
stored them (float32 of noisy norms: their low mantissa bits do not compress).

Printed per filter: bytes per step (file size / steps), the CPU time per step of the writes and
flushes, the analyzer's cost to read the two tables back (per step: a million-step trace takes a
million times that), and the size a compressed dataset would have needed without SWMR's
reallocation (the same data written once, as a lower bound).
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = os.path.join(os.path.dirname(HERE), "sample_traces")

FILTERS = {
    "none (the recorder's choice)": {},
    "lzf": {"compression": "lzf"},
    "gzip 1": {"compression": "gzip", "compression_opts": 1},
    "shuffle + gzip 1": {"compression": "gzip", "compression_opts": 1, "shuffle": True},
    "shuffle + lzf": {"compression": "lzf", "shuffle": True},
    "gzip 6": {"compression": "gzip", "compression_opts": 6},
}


def real_rows(width: int) -> dict[str, np.ndarray]:
    """Rows of real per-step statistics, `width` wide, from the shipped sample traces."""
    grads, weights, losses = [], [], []
    for path in sorted(glob.glob(os.path.join(SAMPLES, "*", "rank0.h5"))):
        with h5py.File(path, "r") as f:
            g = f["params/grad_norm"][()]
            grads.append(g.ravel())
            weights.append(f["params/param_norm"][()].ravel())
            losses.append(f["steps/loss"][()])
    g, w, loss = (np.concatenate(a) for a in (grads, weights, losses))
    n = min(len(g), len(w)) // width
    return {"grad_norm": g[: n * width].reshape(n, width).astype(np.float32),
            "param_norm": w[: n * width].reshape(n, width).astype(np.float32),
            "loss": loss.astype(np.float64)}


def chunk_rows(width: int, itemsize: int) -> int:
    return int(max(16, min(4096, (32 * 1024) // max(1, width * itemsize))))  # recorder/trace_file/writer.py


def write(path: str, rows: dict, steps: int, flush_every: int, opts: dict) -> float:
    """Write `steps` steps with a flush every `flush_every`; return the CPU seconds spent."""
    width = rows["grad_norm"].shape[1]
    f = h5py.File(path, "w", libver="latest", rdcc_nbytes=64 * 1024)
    ds = {name: f.create_dataset(f"params/{name}", shape=(0, width), maxshape=(None, width), dtype="f4",
                                 chunks=(chunk_rows(width, 4), width), **opts)
          for name in ("grad_norm", "param_norm")}
    scalars = {name: f.create_dataset(f"steps/{name}", shape=(0,), maxshape=(None,), dtype="f8",
                                      chunks=(1024,), **opts) for name in ("loss", "time_s", "rss_bytes")}
    f.swmr_mode = True
    n_real = len(rows["grad_norm"])
    t0 = time.process_time()
    for start in range(0, steps, flush_every):
        stop = min(steps, start + flush_every)
        idx = np.arange(start, stop) % n_real
        for name, d in ds.items():
            d.resize(stop, axis=0)
            d[start:stop] = rows[name][idx]
        for name, d in scalars.items():
            d.resize(stop, axis=0)
            d[start:stop] = rows["loss"][np.arange(start, stop) % len(rows["loss"])] if name == "loss" \
                else np.arange(start, stop, dtype=np.float64) * 0.05
        f.flush()
    f.close()
    return time.process_time() - t0


def read_back(path: str, repeats: int = 5) -> float:
    """Best CPU seconds to read the parameter tables whole, as the analyzer's blocks do."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        with h5py.File(path, "r") as f:
            for name in ("grad_norm", "param_norm"):
                f[f"params/{name}"][()]
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--flush-every", type=int, nargs="+", default=[50, 500])
    ap.add_argument("--params", type=int, default=200)
    a = ap.parse_args()
    rows = real_rows(a.params)
    tmp = tempfile.mkdtemp(prefix="torchautopsy-filters-")
    print(f"{a.steps:,} steps of a {a.params}-wide parameter table (x2) and 3 scalar columns, "
          f"real values from {len(rows['grad_norm']):,} rows of the sample traces\n")
    print("| filter | flush every | bytes per step | write CPU per step | read per step | written once (lower bound) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for fe in a.flush_every:
        for label, opts in FILTERS.items():
            path = os.path.join(tmp, "t.h5")
            cpu = write(path, rows, a.steps, fe, opts)
            size = os.path.getsize(path)
            read = read_back(path)
            write(path, rows, a.steps, a.steps, opts)  # one write: no chunk is rewritten
            once = os.path.getsize(path)
            os.remove(path)
            print(f"| {label} | {fe} steps | {size / a.steps:,.0f} | {cpu / a.steps * 1e6:,.0f} µs | "
                  f"{read / a.steps * 1e6:,.1f} µs | {once / a.steps:,.0f} |", flush=True)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
