"""The CNN loop under glibc's malloc as users have it: fresh processes, no MALLOC_* variables.

    python benchmarks/allocator.py                      # 6 bare + 6 recorded processes
    python benchmarks/allocator.py --procs 10 --steps 200 --warmup 100
    python benchmarks/allocator.py --child recorder     # one process, prints its JSON line

Left to itself, glibc's malloc moves its mmap threshold up to the size of the largest mmapped
block freed so far (at most 32 MiB) and its trim threshold to twice that. Whether the CNN's
~64 MiB of activations are given back to the kernel at the end of a step and page-faulted in
again in the next depends on those thresholds and on the heap's layout, which differ from one
process to the next. Counts that do not depend on the machine's load tell the two apart:
minor page faults a step (``ru_minflt``), and glibc's ``mallinfo2()`` at the end (``arena``: bytes
of the main heap, ``hblkhd``: bytes in mmapped blocks, ``keepcost``: the free top of the heap).

What it showed (benchmarks/README.md, "glibc's malloc"): the mmap threshold settles at 8 MiB in
bare and recorded processes alike (the first step's largest activation); what differs is the heap's
layout. The results of a torch.profiler window (steps 10-11) stay alive after their export until a
full GC (``torch.profiler.profile`` is a reference cycle) and cut the heap, grown by the window, into
holes smaller than an activation: every later step took its activations from the heap's top and
gave them back. The recorder now frees them after the export. The extra configurations:
``recorder-noprof`` (no windows), ``recorder-lite`` (windows without shapes and memory events),
``bare-prof`` (the bare loop with one window), ``bare-prof-free`` (its results freed after the
export), ``bare-prof-warm`` (the profiler started once before the loop), ``bare-prof-trim`` and
``recorder-trim`` (``malloc_trim(0)`` after the export), ``recorder-free`` (the results freed on the
writer thread too). ``TORCHAUTOPSY_ALLOC_MARK=1`` makes each step start
with a failing ``access()`` of ``/nonexistent-torchautopsy/step-N``, a marker for
``strace -f -e trace=memory,access``.

Per process: faults a step over the measured steps, mallinfo2 at the end, ms a step (wall; on a
shared machine only the counts are load-independent). Then min/median/max per mode. Bare and
recorded processes alternate. ``--malloc fixed`` runs them with overhead.py's FIXED_MALLOC, for
comparison.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import FIXED_MALLOC, build, train_once  # noqa: E402

SLOW_STEP_FAULTS = 2048  # a step that pages in 8 MiB or more: the heap's top was given back
MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                    "uordblks", "fordblks", "keepcost")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


def mallinfo2() -> dict:
    """glibc's mallinfo2() of the main arena and the mmapped blocks ({} where there is none)."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _Mallinfo2
    info = fn()
    return {name: getattr(info, name) for name in MALLINFO2_FIELDS}


def child(config: str, steps: int, warmup: int) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, opt, loss_fn, batches = build("cnn")
    model.train()
    with tempfile.TemporaryDirectory(prefix="torchautopsy-alloc-") as tmp:
        rec = prof = None
        if config in ("recorder", "recorder-noprof", "recorder-lite", "recorder-trim",
                      "recorder-free"):
            from torchautopsy import Recorder
            if config in ("recorder-trim", "recorder-free"):
                # after the window's export, on the writer thread: malloc_trim(0), or its results freed
                from torchautopsy.recorder.profiler import profile_windows as _profiler
                task = _profiler._task

                def after(prof, *a):
                    run = task(prof, *a)

                    def run_then(writer):
                        out = run(writer)
                        if config == "recorder-trim":
                            ctypes.CDLL(None).malloc_trim(0)
                        else:
                            prof.profiler = None
                        return out
                    return run_then
                _profiler._task = after
            if config == "recorder-lite":  # its windows without input shapes and memory events
                full = torch.profiler.profile

                class Lite(full):
                    def __init__(self, *a, **k):
                        super().__init__(*a, **{**k, "record_shapes": False, "profile_memory": False})
                torch.profiler.profile = Lite
            options = {"profile_steps": 0} if config == "recorder-noprof" else {}
            rec = Recorder(model, os.path.join(tmp, "run"), **options)
        elif config not in ("bare", "bare-prof", "bare-prof-trim", "bare-prof-warm", "bare-prof-free"):
            raise SystemExit(f"unknown config {config!r} (see --configs)")
        if config == "bare-prof-warm":  # the profiler's first start and stop before the loop
            warm = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          record_shapes=True, profile_memory=True)
            warm.start()
            torch.ones(1).add_(1)
            warm.stop()
            del warm
        libc = ctypes.CDLL(None)

        mark = os.environ.get("TORCHAUTOPSY_ALLOC_MARK")  # strace -e trace=memory,access sees the steps

        def step(i: int) -> None:
            if mark:
                os.access(f"/nonexistent-torchautopsy/step-{i}", os.F_OK)
            nonlocal prof
            if config.startswith("bare-prof") and i in (10, 12):  # the recorder's first window, alone
                if prof is None:
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                  record_shapes=True, profile_memory=True)
                    prof.start()
                else:
                    prof.stop()
                    prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
                    if config == "bare-prof-free":  # its results freed now, not by the cyclic GC
                        prof.profiler = None
                    prof = None
                    if config == "bare-prof-trim":
                        libc.malloc_trim(0)
            loss = train_once(model, opt, loss_fn, batches[i % len(batches)])
            if rec is not None:
                rec.step(loss=loss)
            else:
                loss.item()

        for i in range(warmup):
            step(i)
        minflt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # noqa: E731
        per_step = []  # the faults of each measured step: when a process changes mode, and why
        flt0, t0 = minflt(), time.perf_counter()
        for i in range(warmup, warmup + steps):
            f = minflt()
            step(i)
            per_step.append(minflt() - f)
        wall = time.perf_counter() - t0
        faults = minflt() - flt0
        info = mallinfo2()
        if rec is not None:
            rec.close()
    return {"config": config, "steps": steps, "warmup": warmup, "faults_per_step": faults / steps,
            "ms_per_step": wall / steps * 1e3, "mallinfo2": info, "faults": per_step}


def run_child(config: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if args.malloc == "fixed":
        env.update(FIXED_MALLOC)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"child {config} failed, rc={p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str) -> str:
    return "/".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def report(r: dict, label: str) -> None:
    m = r["mallinfo2"]
    slow = sum(f >= SLOW_STEP_FAULTS for f in r["faults"])
    print(f"{label} {r['config']:9} {r['faults_per_step']:11.0f} {slow:>5}/{len(r['faults']):<5} "
          f"{m.get('arena', 0) / 2**20:9.1f} {m.get('hblkhd', 0) / 2**20:10.1f} "
          f"{m.get('keepcost', 0) / 2**10:12.0f} {r['ms_per_step']:8.2f}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=6, help="fresh processes per mode (default 6)")
    ap.add_argument("--steps", type=int, default=200, help="measured steps (default 200: steps 100-300)")
    ap.add_argument("--warmup", type=int, default=100, help="steps before them (default 100)")
    ap.add_argument("--configs", default="bare,recorder", help="comma-separated: bare,recorder (also: recorder-noprof, without "
                    "profiler windows; recorder-lite, windows without shapes and memory; bare-prof, bare "
                    "with one profiler window at steps 10-11; bare-prof-free, -warm, -trim; recorder-trim, "
                    "-free: see the docstring)")
    ap.add_argument("--malloc", choices=("glibc", "fixed"), default="glibc",
                    help="glibc's thresholds left to glibc (default) or overhead.py's FIXED_MALLOC")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes at a time (default 1; more: the counts hold, the times do not)")
    ap.add_argument("--json", metavar="PATH", help="also write every process's measurements to PATH")
    ap.add_argument("--child", metavar="CONFIG", help="run one process's loop here and print its JSON")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.warmup)))
        return

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    order = [c for k in range(args.procs) for c in (configs if k % 2 == 0 else configs[::-1])]
    print(f"cnn, 1 thread, {args.steps} steps after {args.warmup}, malloc {args.malloc}, "
          f"{args.procs} fresh processes per mode, {args.jobs} at a time", flush=True)
    print(f"{'':14} {'faults/step':>11} {'slow steps':>11} {'arena MiB':>9} {'hblkhd MiB':>10} "
          f"{'keepcost KiB':>12} {'ms/step':>8}")
    runs = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # bare and recorded alternate in `order`
        for k, r in enumerate(pool.map(lambda c: run_child(c, args), order)):
            runs.append(r)
            report(r, f"[{k + 1:2}]")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(runs, f, indent=1)
    print(f"\nmin/median/max over the processes (slow step: >= {SLOW_STEP_FAULTS} faults, 8 MiB paged in):")
    for c in configs:
        mine = [r for r in runs if r["config"] == c]
        slow = [sum(f >= SLOW_STEP_FAULTS for f in r["faults"]) / len(r["faults"]) * 100 for r in mine]
        print(f"  {c:9} faults/step {spread([r['faults_per_step'] for r in mine], '.0f')}   "
              f"slow steps % {spread(slow, '.0f')}   "
              f"ms/step {spread([r['ms_per_step'] for r in mine], '.1f')}   ({len(mine)} processes)")


if __name__ == "__main__":
    main()
