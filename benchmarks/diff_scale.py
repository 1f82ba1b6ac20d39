"""How `diff` scales with the length of two runs: time and peak memory of the comparison of two
synthetic traces (benchmarks/synthetic_trace.py, the recorder's real format), in a fresh process.

    python benchmarks/diff_scale.py                       # 1M steps x 200 tensors
    python benchmarks/diff_scale.py --steps 100000 --dir /tmp/traces

Three pairs: a copy (a hard link where the file system allows: the same bytes; the exact
regime, read to the end: identical), the same seed with B exploding at 90% of the run (exact,
read up to where B parts), and another seed of the same model (the noise regime, read to the
end: nothing parts). For each, the comparison alone (`diff_runs` without findings) and the whole
command (`torchautopsy diff --json`, which also runs the detectors over both runs; `--html` adds
the report): wall time, CPU seconds of the process tree, the peak of the tree's summed RSS and
PSS (sampled every 0.1 s), and the machine's load average when it ended. Target (issue 39):
1,000,000 steps x 200 tensors compared in under 30 s and under 1 GiB. Traces are kept in --dir
and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from many_ranks import _memory, _tree  # noqa: E402  (the process tree's memory, from /proc)
_COMPARE = ("import sys, json; from torchautopsy import load; from torchautopsy.analyzer.diff import diff_runs; "
            "d = diff_runs(load(sys.argv[1]), load(sys.argv[2])); print(json.dumps(d.to_dict()['parted']))")


def _timed(cmd: list[str]) -> tuple[float, float, int, int, str]:
    """(wall seconds, CPU seconds, peak summed RSS and PSS bytes of its process tree, stdout) of
    a command in a fresh process; CPU time counts every process it started and waited for."""
    before = os.times()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "MPLBACKEND": "Agg"})
        rss = pss = 0
        while proc.poll() is None:
            mem = [_memory(p) for p in _tree(proc.pid)]
            pss, rss = max(pss, sum(m[0] for m in mem)), max(rss, sum(m[1] for m in mem))
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read()
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu, rss, pss, text


def _trace(base: str, name: str, steps: int, params: int, *extra: str) -> str:
    run = os.path.join(base, name)
    if not os.path.exists(os.path.join(run, "rank0.h5")):
        print(f"writing {run} ...", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, "synthetic_trace.py"), run, "--steps", str(steps),
                        "--params", str(params), *extra], check=True, stdout=subprocess.DEVNULL)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--dir", default=None, help="where traces are written and reused (default: a temporary dir)")
    ap.add_argument("--no-cli", action="store_true", help="time the comparison alone, not the whole command")
    ap.add_argument("--cli-only", action="store_true", help="time the whole command, not the comparison alone")
    ap.add_argument("--html", action="store_true", help="the whole command writes the HTML report too")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="torchautopsy-diff-")
    n, p = a.steps, a.params
    ref = _trace(base, f"a_{n}_{p}", n, p)
    copy = os.path.join(base, f"copy_{n}_{p}")
    if not os.path.exists(copy):
        os.makedirs(copy)
        try:
            os.link(os.path.join(ref, "rank0.h5"), os.path.join(copy, "rank0.h5"))
        except OSError:
            shutil.copy(os.path.join(ref, "rank0.h5"), copy)
    pairs = [("a copy", copy),
             ("same seed, B explodes at 90%", _trace(base, f"b_explode_{n}_{p}", n, p, "--explode-at", str(n * 9 // 10))),
             ("another seed", _trace(base, f"b_seed1_{n}_{p}", n, p, "--seed", "1", "--levels-seed", "0"))]
    rows = []
    for label, other in pairs:
        if not a.cli_only:
            wall, cpu, rss, pss, out = _timed([sys.executable, "-c", _COMPARE, ref, other])
            rows.append((label, "diff_runs", wall, cpu, rss, pss, os.getloadavg()[0], out.strip()))
            print(f"  {label}: comparison {wall:.1f} s ({cpu:.1f} CPU-s), {rss / 2**20:.0f} MiB: parted {out.strip()}",
                  flush=True)
        if not a.no_cli:
            html = ["--html", os.path.join(base, "diff.html")] if a.html else []
            wall, cpu, rss, pss, out = _timed([sys.executable, "-m", "torchautopsy", "diff", ref, other, "--json", "-",
                                               *html])
            parted = json.loads(out)["parted"] if out.strip().startswith("{") else out[:80]
            what = "torchautopsy diff --json" + (" --html" if a.html else "")
            rows.append((label, what, wall, cpu, rss, pss, os.getloadavg()[0], json.dumps(parted)))
            print(f"  {label}: command {wall:.1f} s ({cpu:.1f} CPU-s), {rss / 2**20:.0f} MiB", flush=True)
    print(f"\n{n:,} steps x {p} parameter tensors and {p} modules (python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs)\n")
    print("| pair | what | wall time | CPU time | peak RSS (tree) | peak PSS (tree) | load after | parted |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for label, what, wall, cpu, rss, pss, load, parted in rows:
        print(f"| {label} | {what} | {wall:.1f} s | {cpu:.1f} s | {rss / 2**20:,.0f} MiB | {pss / 2**20:,.0f} MiB "
              f"| {load:.1f} | {parted} |")
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
