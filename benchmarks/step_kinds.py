"""Where the recorder's time goes, by kind of step: a recorded and a bare copy of a workload in one
process (as `overhead.py --paired`), each recorded step tagged with what it did.

    python benchmarks/step_kinds.py mlp --threads 2          # wall time, 2 intra-op threads
    python benchmarks/step_kinds.py transformer --threads 1  # main-thread CPU time, 1 thread

Prints, per kind (plain, watched, hist, update, window, prof, snap, census and their mixes), how
many recorded steps were of it, their median and mean against the bare copy's, the median of
`rec.step()` alone, and its share of the recorded copy's extra time, amortized over all measured
steps; then the writer thread's CPU and `close()`. Reads the recorder's schedule attributes, so it
follows the recorder's internals, not a public API.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import WORKLOADS, build, train_once  # noqa: E402


def kind_of(rec) -> str:
    """What the coming step of the recorder does besides a plain step."""
    s, parts = rec._step, []
    if rec._watched:
        parts.append("hist" if rec.watcher.sample_histograms else "watched")
    if rec.profiler.prof is not None:
        parts.append("prof")
    if s == rec.planner.next_update or s + 1 == rec.planner.next_update:
        parts.append("update")
    if rec.activity.window_ends(s):
        parts.append("window")
    if rec.captures.snapshots is not None and rec.captures.snapshots.due(s + 1):
        parts.append("snap")
    return "+".join(parts) or "plain"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--threads", type=int, default=2, help="1: main-thread CPU time; more: wall time (default 2)")
    ap.add_argument("--steps", type=int, default=1000, help="measured steps of each copy (default 1000)")
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args(argv)

    import torch
    from torchautopsy import Recorder

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    model_a, opt_a, loss_fn, batches = build(args.workload)
    torch.manual_seed(0)
    model_b, opt_b, _, _ = build(args.workload)
    with tempfile.TemporaryDirectory(prefix="torchautopsy-kinds-") as tmp:
        rec = Recorder(model_a, os.path.join(tmp, "run"))
        writer_clock = time.pthread_getcpuclockid(rec.writer._thread.ident)
        recorded, in_step, bare = collections.defaultdict(list), collections.defaultdict(list), []

        def train(i: int, is_recorded: bool, keep: bool) -> None:
            model, opt = (model_a, opt_a) if is_recorded else (model_b, opt_b)
            kind = kind_of(rec) if is_recorded else ""
            t = clock()
            loss = train_once(model, opt, loss_fn, batches[i % len(batches)])
            t_step = clock()
            if is_recorded:
                rec.step(loss=loss)
            else:
                loss.item()
            end = clock()
            if is_recorded and rec.memory._last_census == i:
                kind += "+census"
            if keep and is_recorded:
                recorded[kind].append(end - t)
                in_step[kind].append(end - t_step)
            elif keep:
                bare.append(end - t)

        for i in range(args.warmup):
            train(i, True, False)
            train(i, False, False)
        i = args.warmup
        while i % 10 != 5:  # blocks start off the multiples of 10, as in overhead.py --paired
            train(i, True, False)
            train(i, False, False)
            i += 1
        w0, n = time.clock_gettime(writer_clock), 0
        while n < args.steps:
            for is_recorded in ((True, False) if (i // 10) % 2 else (False, True)):
                for k in range(10):
                    train(i + k, is_recorded, True)
            n, i = n + 10, i + 10
        writer = time.clock_gettime(writer_clock) - w0
        t = clock()
        rec.close()
        close = clock() - t

    b_mean, b_med = statistics.fmean(bare), statistics.median(bare)
    print(f"{args.workload}, {args.threads} thread(s), {n} steps of each copy: bare {b_med * 1e3:.3f} ms a step "
          f"(median), {b_mean * 1e3:.3f} (mean)")
    total = 0.0
    for kind, xs in sorted(recorded.items(), key=lambda kv: -len(kv[1])):
        extra = sum(x - b_mean for x in xs) / n
        total += extra
        print(f"  {kind:22s} n={len(xs):4d}  median {statistics.median(xs) * 1e3:8.3f} ms "
              f"(+{(statistics.median(xs) - b_med) * 1e3:.3f})  rec.step() {statistics.median(in_step[kind]) * 1e3:.3f} ms"
              f"  amortized +{extra * 1e3:.3f} ms a step")
    print(f"  all recorded steps: +{total * 1e3:.3f} ms a step ({1 + total / b_mean:.4f}x); writer thread "
          f"{writer / n * 1e3:.3f} ms of CPU a step; close() {close * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
