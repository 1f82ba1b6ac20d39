"""ATen ops dispatched per training step, by kind of step, with and without the recorder.

    python benchmarks/op_counts.py                       # the three workloads, both paths, the table
    python benchmarks/op_counts.py --workloads mlp --ops watched   # and the ops a watched step adds
    python benchmarks/op_counts.py --cuda        # on a GPU: also host syncs, kernels and ms per kind of step

On a GPU every op the recorder dispatches is a kernel launch (or a view's bookkeeping) that a
launch-bound step pays in full. The count does not depend on the machine, its load or its clock,
so it is measured on the CPU and held by a test (tests/recorder/test_op_counts.py), for both of
the recorder's paths (recorder/reductions/fused.py): the GPU's (fused reductions, forced here with
``fused_reductions=True``: the same ops a GPU dispatches) and the CPU's (per-tensor reductions,
the faster ones on a CPU, where an op launches nothing). Counted with a TorchDispatchMode around
the whole iteration:
forward, loss, backward, optimizer step and ``rec.step()`` (the bare loop's own ``loss.item()``
in its place). Views and detaches count as ops too (they dispatch; they launch no kernel): the
table also gives the count without them.

Each step's kind is read back from the trace the run wrote: *watched* (module outputs measured),
*histogram*, *update* (the two steps of an update ratio: the copy, then the ratio), *window* (a
torch.profiler window), *census* (the live-tensor census), *fingerprint* (replica fingerprints),
*plain* (none of these). A step can be
of several kinds; it is counted under the most expensive ("watched+histogram" under histogram).
The bare loop's steps are all alike after the first: its median is the reference.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import build as overhead_build, train_once  # noqa: E402

WORKLOADS = ("transformer", "mlp", "cnn")
KINDS = ("plain", "watched", "histogram", "update", "window", "census", "fingerprint")
# Replica fingerprints every 13th step here (default 100, a multiple of the warm-up's watched
# steps, with which they would always coincide): they fall on otherwise plain steps, counted apart
# (a step of another kind as well is counted under neither).
FINGERPRINT_EVERY = 13
# Ops that only make a new view of a tensor's storage (or a detached alias): no kernel runs.
VIEWS = {"view", "_unsafe_view", "_reshape_alias", "as_strided", "detach", "alias", "t", "transpose",
         "permute", "expand", "select", "slice", "unsqueeze", "squeeze", "unbind", "split", "split_with_sizes",
         "chunk", "narrow", "unflatten", "flatten", "reshape", "view_as", "diagonal", "lift_fresh",
         "_to_copy_view"}


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while it is active, by name (e.g. 'addmm')."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def views(ops: collections.Counter) -> int:
    return sum(n for name, n in ops.items() if name in VIEWS)


def n_params(workload: str) -> int:
    """The workload's parameter tensors (a fingerprint step reduces each once)."""
    return len(list(build(workload)[0].parameters()))


def build(workload: str, batch: int | None = None):
    """The model, optimizer, loss and batches of a workload: overhead.py's MLP and CNN with AdamW,
    and a 6-layer nn.TransformerEncoder (d 128, 4 heads, sequence 32, batch 8) with AdamW.
    ``batch``: each batch cut to its first ``batch`` samples (the ops dispatched do not depend on
    the batch's size, their work does: the test counts on small batches)."""
    model, opt, loss_fn, batches = _build(workload)
    if batch is not None:
        batches = [(x[:batch], y[:batch]) for x, y in batches]
    return model, opt, loss_fn, batches


def _build(workload: str):
    from torch import nn

    torch.manual_seed(0)
    if workload in ("mlp", "cnn"):
        model, _, loss_fn, batches = overhead_build(workload)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn, batches
    if workload != "transformer":
        raise ValueError(f"unknown workload {workload!r}")

    class Encoder(nn.Module):
        def __init__(self, vocab=500, d=128, heads=4, n_layers=6, seq=32):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(1, seq, d))
            layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.pos))

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, 500, (8, 32), generator=g)
        batches.append((tokens, torch.roll(tokens, -1, dims=1)))
    ce = nn.CrossEntropyLoss()

    def loss_fn(out, y):
        return ce(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    model = Encoder()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss_fn, batches


def count_steps(workload: str, steps: int, recorded: bool, run_dir: str | None = None, device: str = "cpu",
                instrument: str = "ops", batch: int | None = None, **options) -> list:
    """Per training iteration (rec.step() included when recorded): a Counter of the ops dispatched
    (instrument "ops"), or on a GPU {"syncs", "kernels"} (instrument "cuda": host syncs seen by
    CUDA's sync debug mode, kernels and copies seen by torch.profiler) or its seconds ("time")."""
    from torchautopsy import Recorder

    torch.set_num_threads(1)
    model, opt, loss_fn, batches = build(workload, batch)
    dev = torch.device(device)
    model.to(dev)  # (the optimizer keeps the same Parameter objects)
    batches = [(x.to(dev), y.to(dev)) for x, y in batches]
    model.train()
    rec = Recorder(model, run_dir, **options) if recorded else None
    out = []
    try:
        for step in range(steps):
            x, y = batches[step % len(batches)]

            def one_step():
                loss = train_once(model, opt, loss_fn, (x, y))
                if rec is not None:
                    rec.step(loss=loss)
                else:
                    loss.item()  # what a bare loop that logs its loss does

            if instrument == "ops":
                with OpCounter() as counter:
                    one_step()
                out.append(counter.ops)
            elif instrument == "cuda":
                out.append(_cuda_counts(one_step))
            else:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                one_step()
                torch.cuda.synchronize()
                out.append(time.perf_counter() - t0)
    finally:
        if rec is not None:
            rec.close()
    return out


def _cuda_counts(one_step) -> dict:
    """Host syncs (CUDA's sync debug mode warns at each) and device kernels and copies (the
    profiler's CUDA events) of one step."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                one_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message))
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"syncs": syncs, "kernels": kernels}


def measure_cuda(workload: str, steps: int = 60) -> dict:
    """On a GPU: per kind of step, the median host syncs, kernels and milliseconds, bare and
    recorded (the GPU's own path; no profiler windows, whose profiler would meet ours)."""
    import numpy as np

    out = {"workload": workload, "kinds": {}}
    bare_c = count_steps(workload, 12, False, device="cuda", instrument="cuda")[4:]
    bare_t = count_steps(workload, 40, False, device="cuda", instrument="time")[10:]
    out["bare"] = {"syncs": statistics.median(c["syncs"] for c in bare_c),
                   "kernels": statistics.median(c["kernels"] for c in bare_c),
                   "ms": 1e3 * statistics.median(bare_t)}
    with tempfile.TemporaryDirectory(prefix="torchautopsy-ops-") as a, \
            tempfile.TemporaryDirectory(prefix="torchautopsy-ops-") as b:
        counts = count_steps(workload, steps, True, a, device="cuda", instrument="cuda", profile_steps=0)
        times = count_steps(workload, steps, True, b, device="cuda", instrument="time", profile_steps=0)
        kinds_c, kinds_t = step_kinds(a, steps), step_kinds(b, steps)
    for kind in KINDS:
        ic = [i for i, k in enumerate(kinds_c) if k == kind and i > 0]
        it = [i for i, k in enumerate(kinds_t) if k == kind and i > 0]
        if ic and it:
            out["kinds"][kind] = {"steps": len(ic),
                                  "syncs": float(np.median([counts[i]["syncs"] for i in ic])),
                                  "kernels": float(np.median([counts[i]["kernels"] for i in ic])),
                                  "ms": 1e3 * float(np.median([times[i] for i in it]))}
    return out


def cuda_table(results: list[dict]) -> str:
    lines = ["| workload | kind of step | steps | host syncs (bare) | kernels (bare) | ms (bare) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        b = r["bare"]
        for kind, k in r["kinds"].items():
            lines.append(f"| {r['workload']} | {kind} | {k['steps']} | {k['syncs']:g} ({b['syncs']:g}) | "
                         f"{k['kernels']:g} ({b['kernels']:g}) | {k['ms']:.2f} ({b['ms']:.2f}) |")
    return "\n".join(lines)


def step_kinds(run_dir: str, n: int) -> list[str]:
    """The kind of each recorded step, from the trace (see the module's docstring)."""
    import numpy as np

    from torchautopsy import load

    rt = load(run_dir).ranks[0]
    kinds = [set() for _ in range(n)]
    watched = rt.module_rows().to_numpy()
    for i in np.flatnonzero((watched != -1).any(axis=1)):
        kinds[i].add("watched")
    for s in rt.histogram_steps:
        kinds[int(s)].add("histogram")
    for s in rt.sample_steps("updates"):
        kinds[int(s)].add("update")
        if s > 0:
            kinds[int(s) - 1].add("update")
    live = rt.steps["live_tensors"].to_numpy()
    for i in np.flatnonzero(np.isfinite(live)):
        kinds[i].add("census")
    windows = rt.profile_windows
    if windows is not None:
        for w in windows.itertuples():
            for s in range(int(w.step_start), int(w.step_end) + 1):
                kinds[s].add("window")
    for s in rt.fingerprint_steps:
        kinds[int(s)].add("fingerprint")
    order = ("histogram", "window", "watched", "census", "update", "fingerprint")
    return ["mixed" if "fingerprint" in ks and len(ks) > 1 else next((k for k in order if k in ks), "plain")
            for ks in kinds]


def measure(workload: str, steps: int = 120, fused: bool = True, batch: int | None = None) -> dict:
    """{'bare': median ops of a bare step, 'bare_compute': without views, kind: {...}} where each
    kind has its steps, the median ops added (all, and without views) and the ops of its median
    step by name (added over the bare step). ``fused``: the GPU's path (else the CPU's). ``batch``:
    see build()."""
    bare = count_steps(workload, 8, recorded=False, batch=batch)[2:]
    bare_ops = bare[len(bare) // 2]
    with tempfile.TemporaryDirectory(prefix="torchautopsy-ops-") as tmp:
        recorded = count_steps(workload, steps, recorded=True, run_dir=tmp, fused_reductions=True if fused else None,
                               fingerprint_every=FINGERPRINT_EVERY, batch=batch)
        kinds = step_kinds(tmp, steps)
    out = {"workload": workload, "path": "GPU (fused)" if fused else "CPU", "bare": sum(bare_ops.values()),
           "bare_compute": sum(bare_ops.values()) - views(bare_ops), "kinds": {}}
    for kind in KINDS:
        idx = [i for i, k in enumerate(kinds) if k == kind and i > 0]  # step 0: first calls, once
        if not idx:
            continue
        added = sorted(((sum(recorded[i].values()) - out["bare"]), i) for i in idx)
        med, i = added[len(added) // 2]
        extra = recorded[i].copy()
        extra.subtract(bare_ops)
        out["kinds"][kind] = {"steps": len(idx), "added": med,
                              "added_compute": med - (views(recorded[i]) - views(bare_ops)),
                              "ops": {k: v for k, v in extra.most_common() if v}}
    return out


def table(results: list[dict]) -> str:
    lines = ["| workload | bare step: ops (without views) | recorder's path | kind of step | steps | ops added "
             "(without views) | added / bare |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for kind, k in r["kinds"].items():
            lines.append(f"| {r['workload']} | {r['bare']:,} ({r['bare_compute']:,}) | {r['path']} | {kind} | "
                         f"{k['steps']} | {k['added']:+,} ({k['added_compute']:+,}) | {k['added'] / r['bare']:+.0%} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=120, help="recorded steps (default 120: the warm-up's kinds)")
    ap.add_argument("--paths", default="gpu,cpu", help="the recorder's paths: gpu (fused), cpu (default: both)")
    ap.add_argument("--ops", metavar="KIND", help="also list the ops a step of this kind adds, by name")
    ap.add_argument("--cuda", action="store_true",
                    help="also count host syncs and kernels and time each kind of step on the GPU")
    args = ap.parse_args(argv)
    paths = [p.strip() == "gpu" for p in args.paths.split(",")]
    results = [measure(w, args.steps, fused) for w in args.workloads.split(",") for fused in paths]
    print(table(results))
    if args.cuda:
        if not torch.cuda.is_available():
            sys.exit("op_counts.py: --cuda needs a CUDA device")
        print()
        print(cuda_table([measure_cuda(w) for w in args.workloads.split(",")]))
    if args.ops:
        for r in results:
            k = r["kinds"].get(args.ops)
            if k:
                print(f"\n{r['workload']}, {r['path']} path, a {args.ops} step adds:")
                print(", ".join(f"{name} {n:+}" for name, n in k["ops"].items()))


if __name__ == "__main__":
    main()
