"""How the analyzer scales with the length of a run: time and peak memory of
`torchautopsy analyze RUN --json F --html F` on synthetic traces of growing length.

    python benchmarks/analyzer_scale.py                       # 100k, 300k and 1M steps x 200 tensors
    python benchmarks/analyzer_scale.py --steps 10000 100000 --params 200 --dir /tmp/traces

Each trace is written by benchmarks/synthetic_trace.py in the recorder's real format (with an
explosion at 90% of the run, so that findings, their figures and the report are built too) and
analysed in a fresh process; peak RSS is that process's own (wait4), wall time includes its
start-up. Targets (issue 7): 1,000,000 steps x 200 tensors under 60 s and under 1 GB, with memory
that does not grow with the steps x tensors tables. Traces are kept in --dir and reused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def analyze(run_dir: str, out_dir: str) -> tuple[float, int, int]:
    """(wall seconds, CPU seconds, peak RSS bytes, exit code) of one `analyze --json --html`, in a fresh process."""
    cmd = [sys.executable, "-m", "torchautopsy.analyzer.cli", "analyze", run_dir,
           "--json", os.path.join(out_dir, "findings.json"), "--html", os.path.join(out_dir, "report.html")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "MPLBACKEND": "Agg"})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, int(usage.ru_maxrss) * 1024, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where traces are written and reused (default: a temporary dir)")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="torchautopsy-scale-")
    rows = []
    for n in a.steps:
        run = os.path.join(base, f"steps{n}_params{a.params}")
        if not os.path.exists(os.path.join(run, "rank0.h5")):
            print(f"writing a {n:,}-step trace to {run} ...", flush=True)
            subprocess.run([sys.executable, os.path.join(HERE, "synthetic_trace.py"), run, "--steps", str(n),
                            "--params", str(a.params), "--explode-at", str(n * 9 // 10)],
                           check=True, stdout=subprocess.DEVNULL)
        out = tempfile.mkdtemp(prefix="out-", dir=base)
        wall, cpu, rss, rc = analyze(run, out)
        size = os.path.getsize(os.path.join(run, "rank0.h5"))
        html = os.path.getsize(os.path.join(out, "report.html")) if rc in (0, 1) else 0
        rows.append((n, size, wall, cpu, rss, html, rc))
        shutil.rmtree(out, ignore_errors=True)
        print(f"  {n:>9,} steps: {wall:5.1f} s ({cpu:.1f} CPU-s), peak RSS {rss / 2**20:5.0f} MiB (exit {rc})",
              flush=True)

    print(f"\nanalyze --json --html, {a.params} parameter tensors, {a.params} modules "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} CPUs)\n")
    print("| steps | trace size | wall time | CPU time | peak RSS | HTML report |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, size, wall, cpu, rss, html, rc in rows:
        note = "" if rc in (0, 1) else f" (exit {rc})"
        print(f"| {n:,} | {size / 2**30:.2f} GiB | {wall:.1f} s | {cpu:.1f} s | {rss / 2**20:,.0f} MiB | "
              f"{html / 2**10:,.0f} KiB{note} |")
    if len(rows) >= 2:
        (n0, _, w0, _, r0, _, _), (n1, _, w1, _, r1, _, _) = rows[0], rows[-1]
        print(f"\nfrom {n0:,} to {n1:,} steps ({n1 / n0:.0f}x): time x{w1 / w0:.1f}, peak RSS x{r1 / r0:.2f} "
              f"(+{(r1 - r0) / (n1 - n0):.0f} bytes per step: the 1-D per-step series such as loss, "
              f"time and memory; the steps x tensors tables are streamed)")
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
