"""Recorder overhead on three CPU workloads, against the bare loop and TensorBoard histograms.

    python benchmarks/overhead.py                  # defaults: 1,000 steps, 3 repetitions (~1 h)
    python benchmarks/overhead.py --quick          # smoke run
    python benchmarks/overhead.py --workloads mlp --configs bare,recorder --repeats 5

Every measurement runs in a fresh subprocess (this script re-invoked with ``--child``), and the
configurations alternate within each repetition so that they share the machine's conditions.
Two kinds of run:

- CPU: ``torch.set_num_threads(1)``, process CPU time (``time.process_time()``: every thread of
  the process, the recorder's writer thread included);
- wall: ``torch.set_num_threads(2)``, wall-clock time.

The measured span is ``--steps`` steps after ``--warmup`` steps, plus closing the recorder (or the
TensorBoard writer), so that the periodic events (watched steps and update ratios on their
budgets, histograms every 100 steps, tensor samples every 500, the census, the 2-step profiler
window and the parameter snapshot of every 1,000 steps, writes and flushes) are amortized inside it
as a long job pays them: the default 1,000 steps hold each of them at its own rate. (A shorter span
over-weights the 1,000-step events: with --steps 200 the profiler window counts 5 times.) The
default 100 warm-up steps are the recorder's own warm-up, which a job pays once: watched steps and
update ratios every 10th step, the first profiler window (step 10), the first censuses, the copies
taken at creation. The table reports that once-only cost on its own line, measured from the
recorder's creation to the end of the warm-up. Each configuration reports its best (minimum) run:
on a shared machine the noise only ever adds time.

glibc's malloc (``--malloc``). By default every child, bare or not, runs with glibc's mmap and trim
thresholds fixed (``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``, the same for every
configuration). Left to glibc (``--malloc glibc``), whether the CNN's step gives its activations
back to the kernel and page-faults them in again every step is decided by the heap's layout: the
bare loop does it in 20-100% of its steps from one process to the next, and after the recorder's
first profiler window (steps 10-11) in every step of every process (benchmarks/allocator.py
measures it; benchmarks/README.md has the counts). Fixing the thresholds measures the recorder's
own cost rather than that layout. (It is also what CPU training jobs do for speed:
``MALLOC_TRIM_THRESHOLD_``, or jemalloc/tcmalloc by ``LD_PRELOAD``.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("mlp", "cnn", "transformer")
CONFIGS = ("bare", "recorder", "tensorboard")
N_BATCHES = 8  # distinct synthetic batches, generated up front and cycled
# --malloc fixed: glibc's thresholds, fixed (setting either turns off glibc's dynamic adjustment).
# 32 MiB is the ceiling glibc's own adjustment climbs to; a trim threshold of 256 MiB keeps the
# freed top of the heap for the next step rather than giving it back and faulting it in again.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20)}


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Child: one measurement
# ---------------------------------------------------------------------------------------------

def build(workload: str):
    """The model, the optimizer, the loss function and the synthetic batches of a workload."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(0)
    if workload == "mlp":
        layers = []
        for _ in range(8):
            layers += [nn.Linear(512, 512), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(512, 10))
        batches = [(torch.randn(256, 512, generator=g), torch.randint(0, 10, (256,), generator=g))
                   for _ in range(N_BATCHES)]
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elif workload == "cnn":
        def block(cin, cout, stride):
            return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                    nn.BatchNorm2d(cout), nn.ReLU()]
        model = nn.Sequential(*block(3, 32, 1), *block(32, 64, 2), *block(64, 64, 1),
                              *block(64, 128, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(128, 10))
        batches = [(torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g))
                   for _ in range(N_BATCHES)]
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    elif workload == "transformer":
        class Encoder(nn.Module):
            def __init__(self, vocab=1000, d=256, heads=4, n_layers=4, seq=64):
                super().__init__()
                self.embed = nn.Embedding(vocab, d)
                self.pos = nn.Parameter(torch.zeros(1, seq, d))
                layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.1,
                                                   batch_first=True)
                self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
                self.head = nn.Linear(d, vocab)

            def forward(self, tokens):
                return self.head(self.encoder(self.embed(tokens) + self.pos))

        model = Encoder()
        batches = []
        for _ in range(N_BATCHES):
            tokens = torch.randint(0, 1000, (4, 64), generator=g)
            batches.append((tokens, torch.roll(tokens, -1, dims=1)))  # predict the next token
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        raise ValueError(f"unknown workload {workload!r}")

    ce = nn.CrossEntropyLoss()
    if workload == "transformer":
        def loss_fn(out, y):
            return ce(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    else:
        loss_fn = ce
    return model, opt, loss_fn, batches


def train_once(model, opt, loss_fn, batch):
    """One training iteration, up to the optimizer's step: what every configuration and copy
    runs before its own end of step (rec.step(), TensorBoard's calls or loss.item())."""
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def child(workload: str, config: str, steps: int, warmup: int, threads: int, device: str = "cpu") -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, opt, loss_fn, batches = build(workload)
    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    if on_cuda:  # the same model and batches, moved to the GPU before the optimizer's first step
        model.to(dev)
        batches = [(x.to(dev), y.to(dev)) for x, y in batches]
    model.train()

    def sync() -> None:  # a GPU runs behind the host: time its work, not only its launches
        if on_cuda:
            torch.cuda.synchronize(dev)

    with tempfile.TemporaryDirectory(prefix="torchautopsy-bench-") as tmp:
        run_dir = os.path.join(tmp, "run")
        rec = tb = None
        warm_cpu0, warm_wall0 = time.process_time(), time.perf_counter()
        if config == "recorder":
            from torchautopsy import Recorder
            rec = Recorder(model, run_dir)
        elif config == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            tb = SummaryWriter(run_dir)
        elif config != "bare":
            raise ValueError(f"unknown config {config!r}")

        def train_step(i: int) -> None:
            loss = train_once(model, opt, loss_fn, batches[i % len(batches)])
            if rec is not None:
                rec.step(loss=loss)
            elif tb is not None:
                tb.add_scalar("loss", loss.item(), i)
                if i % 100 == 0:
                    for name, p in model.named_parameters():
                        tb.add_histogram(name, p, i)
                        if p.grad is not None:
                            tb.add_histogram(name + ".grad", p.grad, i)
            else:
                loss.item()  # one host read per step, as any loop that logs its loss does

        for i in range(warmup):
            train_step(i)
        sync()

        cpu0, wall0 = time.process_time(), time.perf_counter()
        warm_cpu, warm_wall = cpu0 - warm_cpu0, wall0 - warm_wall0
        for i in range(warmup, warmup + steps):
            train_step(i)
        sync()
        cpu_loop, wall_loop = time.process_time() - cpu0, time.perf_counter() - wall0
        if rec is not None:
            rec.close()
        if tb is not None:
            tb.close()
        sync()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0

        written = dir_bytes(run_dir) if os.path.isdir(run_dir) else 0

    return {
        "workload": workload, "config": config, "threads": threads, "steps": steps,
        "warmup": warmup,
        "cpu_s": cpu, "wall_s": wall, "close_cpu_s": cpu - cpu_loop, "close_wall_s": wall - wall_loop,
        "warmup_cpu_s": warm_cpu, "warmup_wall_s": warm_wall,  # creation + the warm-up steps
        "bytes": written,
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
        "device": device,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(dev) if on_cuda else 0,
    }


def paired_child(workload: str, steps: int, warmup: int, threads: int, block: int = 10) -> dict:
    """Two identical copies of a workload in one process, A recorded and B bare, trained in
    alternating blocks of `block` steps: the same machine state for both, to the block, where
    fresh processes differ by several percent (see print_paired).

    threads=1 (mode cpu): each step's main-thread CPU time; A also pays its close() and the CPU
    of every other thread of the process (the writer's: one intra-op thread, no DataLoader).
    threads=2 (mode wall): each step's wall time; A also pays its close() and the writer
    thread's CPU during B's blocks (work A queued that may run while B trains: counted as if it
    had stalled A, an upper bound)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model_a, opt_a, loss_fn, batches = build(workload)
    torch.manual_seed(0)
    model_b, opt_b, _, _ = build(workload)
    model_a.train()
    model_b.train()
    clock = time.thread_time if threads == 1 else time.perf_counter

    with tempfile.TemporaryDirectory(prefix="torchautopsy-bench-") as tmp:
        from torchautopsy import Recorder

        rec = Recorder(model_a, os.path.join(tmp, "run"))
        writer_clock = time.pthread_getcpuclockid(rec.writer._thread.ident)

        def train_step(model, opt, i: int, recorded: bool) -> float:
            t = clock()
            loss = train_once(model, opt, loss_fn, batches[i % len(batches)])
            if recorded:
                rec.step(loss=loss)
            else:
                loss.item()
            return clock() - t

        for i in range(warmup):
            train_step(model_a, opt_a, i, True)
            train_step(model_b, opt_b, i, False)
        # Blocks start half a block off the multiples of `block`: the recorder times its steps
        # from one rec.step() to the next, so the first step of each of A's blocks also holds
        # B's block. That step must be a plain one, never a sample its budgets are timed from
        # (watched steps, histograms and update ratios fall on multiples of 10).
        i = warmup
        while i % block != block // 2:
            train_step(model_a, opt_a, i, True)
            train_step(model_b, opt_b, i, False)
            i += 1
        t_a = t_b = writer_in_b = 0.0
        n_a = n_b = 0
        proc0, main0 = time.process_time(), time.thread_time()
        while n_a < steps:
            order = (True, False) if (i // block) % 2 else (False, True)  # who goes first alternates
            for recorded in order:
                if recorded:
                    for k in range(min(block, steps - n_a)):
                        t_a += train_step(model_a, opt_a, i + k, True)
                        n_a += 1
                else:
                    w0 = time.clock_gettime(writer_clock)
                    for k in range(block):
                        t_b += train_step(model_b, opt_b, i + k, False)
                        n_b += 1
                    writer_in_b += time.clock_gettime(writer_clock) - w0
            i += block
        t = clock()
        rec.close()
        close = clock() - t
        if threads == 1:  # every other thread's CPU in the span: the writer's
            others = (time.process_time() - proc0) - (time.thread_time() - main0)
        else:
            others = writer_in_b
    return {"workload": workload, "mode": "cpu" if threads == 1 else "wall", "threads": threads,
            "steps": steps, "warmup": warmup, "block": block,
            "recorded_main_s": t_a, "close_main_s": close, "other_threads_s": others,
            "bare_main_s": t_b, "n_recorded": n_a, "n_bare": n_b}


def paired_per_step(r: dict) -> tuple[float, float, float]:
    """(recorded, bare, the recorded copy's close() + writer share) seconds a step of a paired run."""
    extra = r["close_main_s"] + r["other_threads_s"]
    return (r["recorded_main_s"] + extra) / r["n_recorded"], r["bare_main_s"] / r["n_bare"], extra / r["n_recorded"]


def print_rows(header: tuple[str, ...], rows: list[tuple[str, ...]], n_left: int) -> None:
    """A text table: the first n_left columns left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def fmt(cells):
        return " | ".join(c.ljust(wd) if i < n_left else c.rjust(wd) for i, (c, wd) in enumerate(zip(cells, widths)))

    print(fmt(header))
    print("-+-".join("-" * wd for wd in widths))
    for r in rows:
        print(fmt(r))


def print_paired(runs: list[dict], workloads: list[str]) -> None:
    """The paired runs' table: per workload and mode, the recorded and the bare copy's time a step."""
    header = ("workload", "mode", "bare ms/step", "recorded ms/step", "of it: close + writer", "ratio", "runs")
    rows = []
    for w in workloads:
        for mode in ("cpu", "wall"):
            mine = [r for r in runs if r["workload"] == w and r.get("mode", "cpu") == mode]
            if not mine:
                continue
            ratios = sorted((a / b, a, b, extra) for a, b, extra in map(paired_per_step, mine))
            med = ratios[len(ratios) // 2]
            spread = f"{ratios[0][0]:.3f}-{ratios[-1][0]:.3f}x" if len(ratios) > 1 else "-"
            label = "CPU (1 thr)" if mode == "cpu" else "wall (2 thr)"
            rows.append((w, label, f"{med[2] * 1e3:.2f}", f"{med[1] * 1e3:.2f}", f"{med[3] * 1e3:.3f}",
                         f"{med[0]:.3f}x", f"{len(ratios)} ({spread})"))
    print()
    print("paired, in one process (median run, and the runs' range):")
    print_rows(header, rows, 2)
    r0 = runs[0]
    print(f"{r0['steps']} steps of each copy after {r0['warmup']} warm-up steps, in alternating blocks of "
          f"{r0['block']}. CPU: main-thread CPU, the recorded copy also paying its close() and the writer "
          f"thread's CPU. Wall: each step's wall time, the recorded copy also paying its close() and the "
          f"writer's CPU during the bare copy's blocks (as if it had stalled it). Both copies share the "
          f"process, so the bare one also passes the recorder's global hooks (the optimizer pre-hook, "
          f"the activation wrappers), which return at once for it.")


# ---------------------------------------------------------------------------------------------
# Parent: schedule the children, print the table
# ---------------------------------------------------------------------------------------------

def run_child(workload: str, config: str, args, threads: int) -> dict:
    return _run([*(("--paired-child", workload) if config == "paired" else ("--child", workload, config)),
                 "--threads", str(threads), "--device", args.device], args, threads, f"{workload}/{config}")


def _run(child_args: list[str], args, threads: int, what: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    for k in FIXED_MALLOC:
        env.pop(k, None)
    if args.malloc == "fixed":
        env.update(FIXED_MALLOC)
    cmd = [sys.executable, os.path.abspath(__file__), *child_args, "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"child {what} ({threads} threads) failed, rc={p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def parse_list(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from {', '.join(allowed)})")
    return items


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: mlp,cnn,transformer")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: bare,recorder,tensorboard")
    ap.add_argument("--steps", type=int, default=1000, help="measured steps per run (default 1000)")
    ap.add_argument("--warmup", type=int, default=100,
                    help="steps before them, reported apart as a once-only cost (default 100: the recorder's warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration and mode (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 30 steps after 10, 1 repetition")
    ap.add_argument("--malloc", choices=("fixed", "glibc"), default="fixed",
                    help="glibc's malloc thresholds in every run: fixed (default; see above) or "
                         "left to glibc's dynamic adjustment")
    ap.add_argument("--json", metavar="PATH", help="also write every run's measurements to PATH (after each run)")
    ap.add_argument("--table-from", metavar="PATH",
                    help="print the table from the runs a --json PATH saved (an interrupted run's too), run nothing")
    ap.add_argument("--device", default="cpu",
                    help="where the workloads train: cpu (default; the issue's figures) or cuda (a GPU, for comparison)")
    ap.add_argument("--paired", action="store_true",
                    help="instead of the table: each workload's bare and recorded copies in one process, "
                         "alternating blocks of 10 steps, CPU and wall time (--repeats runs of each)")
    ap.add_argument("--paired-child", metavar="WORKLOAD", help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.warmup, args.threads, args.device)))
        return
    if args.paired_child:
        print(json.dumps(paired_child(args.paired_child, args.steps, args.warmup, args.threads)))
        return

    if args.table_from:
        try:
            with open(args.table_from) as f:
                runs = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"--table-from {args.table_from}: cannot read it ({e}); give a file that --json wrote")
        if not isinstance(runs, list) or not runs:
            ap.error(f"--table-from {args.table_from}: no runs in it; give a file that --json wrote")
        order = lambda key, known: [k for k in known if any(r[key] == k for r in runs)]  # noqa: E731
        if all("n_recorded" in r for r in runs):  # a --paired run's
            print_paired(runs, order("workload", WORKLOADS))
            return
        print_table(runs, runs[0]["steps"], runs[0]["warmup"], order("workload", WORKLOADS), order("config", CONFIGS),
                    describe_malloc(runs[0].get("malloc", "fixed")), f"{len(runs)} runs from {args.table_from}")
        return

    if args.quick:
        args.steps, args.repeats, args.warmup = 30, 1, 10
    workloads = parse_list(args.workloads, WORKLOADS, "workload")
    configs = parse_list(args.configs, CONFIGS, "config")
    if "tensorboard" in configs and not tensorboard_available():
        print("tensorboard: skipped (not importable; `pip install tensorboard` to include it)")
        configs.remove("tensorboard")
    if "bare" not in configs:
        print("note: without `bare` there are no ratios")

    malloc_desc = describe_malloc(args.malloc)
    if args.paired:
        if args.device != "cpu":
            ap.error("--paired runs on the CPU only (its wall mode's 2 threads are CPU threads); leave out --device")
        print(f"paired: {len(workloads)} workloads x 2 modes x {args.repeats} repeats, {args.steps} steps of each "
              f"copy after {args.warmup} warm-up steps, malloc thresholds {malloc_desc}", flush=True)
        runs = []
        for rep in range(args.repeats):
            for mode, threads in (("cpu", 1), ("wall", 2)):
                for w in workloads:
                    r = run_child(w, "paired", args, threads)
                    r["malloc"] = args.malloc
                    runs.append(r)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(runs, f, indent=1)
                    a, b, _ = paired_per_step(r)
                    print(f"  [{rep + 1}/{args.repeats}] {mode:4} {w:11} bare {b * 1e3:7.2f}  recorded {a * 1e3:7.2f} "
                          f"ms/step  {a / b:.3f}x", flush=True)
        print_paired(runs, workloads)
        return

    modes = (("cpu", 1), ("wall", 2))
    print(f"{len(workloads)} workloads x {len(configs)} configs x {args.repeats} repeats x 2 modes, "
          f"{args.steps} steps after {args.warmup} warm-up steps, malloc thresholds {malloc_desc}", flush=True)
    t0 = time.perf_counter()
    runs = []
    order = list(configs)
    for rep in range(args.repeats):
        for mode, threads in modes:
            for w in workloads:
                random.Random(rep).shuffle(order)  # no configuration always runs first
                for c in order:
                    r = run_child(w, c, args, threads)
                    r["mode"], r["malloc"] = mode, args.malloc
                    runs.append(r)
                    if args.json:  # after every run: an interrupted benchmark keeps what it measured
                        with open(args.json, "w") as f:
                            json.dump(runs, f, indent=1)
                    per = (r["cpu_s"] if mode == "cpu" else r["wall_s"]) / args.steps * 1e3
                    print(f"  [{rep + 1}/{args.repeats}] {mode:4} {w:11} {c:11} {per:8.2f} ms/step",
                          flush=True)
    elapsed = time.perf_counter() - t0
    print_table(runs, args.steps, args.warmup, workloads, configs, malloc_desc,
                f"{len(runs)} runs in {elapsed:.0f} s")


def describe_malloc(malloc: str) -> str:
    return ("fixed (" + " ".join(f"{k}={v}" for k, v in FIXED_MALLOC.items()) + ")"
            if malloc == "fixed" else "left to glibc")


def print_table(runs: list[dict], steps: int, warmup: int, workloads: list[str], configs: list[str],
                malloc_desc: str, source: str) -> None:
    """The table of best runs, ratios to the bare loop, bytes and memory; the warm-up's cost."""
    counts = [sum(1 for r in runs if (r["workload"], r["config"], r["mode"]) == k)
              for k in {(r["workload"], r["config"], r["mode"]) for r in runs}]
    repeats = str(max(counts)) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"

    def complete(w, c):
        return all(any(r["workload"] == w and r["config"] == c and r["mode"] == m for r in runs)
                   for m in ("cpu", "wall"))

    def least(w, c, mode, key):
        return min(r[key] for r in runs if r["workload"] == w and r["config"] == c and r["mode"] == mode)

    def best(w, c, mode):
        return least(w, c, mode, f"{mode}_s") / steps * 1e3

    header = ("workload", "config", "wall ms/step (2 thr)", "ratio (wall)", "CPU ms/step (1 thr)",
              "ratio (CPU)", "bytes/step", "peak RSS MiB")
    rows = []
    worst = None
    for w in workloads:
        for c in configs:
            if not complete(w, c):  # (a table from an interrupted run's JSON)
                continue
            mine = [r for r in runs if r["workload"] == w and r["config"] == c]
            wall, cpu = best(w, c, "wall"), best(w, c, "cpu")
            if complete(w, "bare"):
                rw, rc = wall / best(w, "bare", "wall"), cpu / best(w, "bare", "cpu")
                ratios = (f"{rw:.3f}x", f"{rc:.3f}x")
                if c == "recorder":
                    for kind, r in (("wall", rw), ("CPU", rc)):
                        if worst is None or r > worst[0]:
                            worst = (r, w, kind)
            else:
                ratios = ("-", "-")
            total_steps = steps + warmup
            bps = max(r["bytes"] for r in mine) / total_steps
            rss = max(r["maxrss_kib"] for r in mine) / 1024
            rows.append((w, c, f"{wall:.2f}", ratios[0], f"{cpu:.2f}", ratios[1], f"{bps:,.0f}",
                         f"{rss:.0f}"))

    print()
    print_rows(header, rows, 2)
    print()
    print(f"best of {repeats} runs each; {steps} steps after {warmup} warm-up, "
          f"the recorder/writer close() included; bytes/step = run dir size / {steps + warmup} "
          f"steps; malloc thresholds {malloc_desc}; {source}")
    if warmup:
        for w in [w for w in workloads if complete(w, "bare") and complete(w, "recorder")]:
            once = {mode: least(w, "recorder", mode, f"warmup_{mode}_s") - least(w, "bare", mode, f"warmup_{mode}_s")
                    for mode in ("cpu", "wall")}
            print(f"recorder warm-up, paid once ({w}: its creation and the first {warmup} steps, not in the "
                  f"ratios): +{once['cpu'] * 1e3:.0f} ms CPU, +{once['wall'] * 1e3:.0f} ms wall over the bare loop")
    device = runs[0].get("device", "cpu")
    if device != "cpu":
        peaks = ", ".join(f"{w}/{c} {max(r['cuda_peak_bytes'] for r in runs if (r['workload'], r['config']) == (w, c)) / 2**20:.0f}"
                          for w in workloads for c in configs if complete(w, c))
        print(f"device {device}; peak GPU memory allocated (MiB): {peaks}")
    if worst is not None:
        print(f"worst ratio of the default recorder: {worst[0]:.3f}x ({worst[1]}, {worst[2]})")


if __name__ == "__main__":
    main()
