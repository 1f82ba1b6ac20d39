"""What recording a torch.compile'd model costs, and what it still records.

    python benchmarks/compile_cost.py                         # inductor, default mode (~1 min)
    python benchmarks/compile_cost.py --mode max-autotune-no-cudagraphs
    python benchmarks/compile_cost.py --steps 1000 --width 512 --configs compiled,compiled+rec
    python benchmarks/compile_cost.py --options '{"blackbox": false}'   # Recorder options (JSON)

Four copies of one model (same seed) train side by side in one process, one step each in turn
(the order rotating every step), so that they share the machine's conditions:

- `eager`, `eager+rec`: the model as it is, without and with `Recorder(model, run_dir)`;
- `compiled`, `compiled+rec`: `torch.compile(model)` (inductor), without and with the recorder.

Each step is timed on the wall clock (one intra-op thread); the first `--warmup` steps (the
compilation, the recorder's own warm-up of watched steps every 10th) are left out of the
per-step times. Compilations are Dynamo's graphs (torch._dynamo.utils.counters), counted for the
configuration whose step made them, with the inductor caches off so that the second compiled
copy pays its compilation as the first did. The losses of the compiled pair are compared bit for
bit; the traces are read back to show what each recorded run measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, ".")
from torchautopsy import Recorder  # noqa: E402

CONFIGS = ("eager", "eager+rec", "compiled", "compiled+rec")


_FORWARD = "def forward(self, x):\n    for m in self:\n        x = m(x)\n    return x\n"


def make_model(name: str, width: int, depth: int) -> nn.Module:
    """An MLP whose forward is a code object of its own: Dynamo caches compiled code per code
    object, and would otherwise hand the second compiled copy the first one's graph."""
    ns: dict = {}
    exec(compile(_FORWARD, f"<forward of {name}>", "exec"), ns)
    cls = type(f"MLP_{name}", (nn.Sequential,), {"forward": ns["forward"]})
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return cls(*layers, nn.Linear(width, 10))


class Run:
    def __init__(self, name: str, args):
        self.name = name
        self.model = make_model(name, args.width, args.depth)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.run_dir = tempfile.mkdtemp(prefix="compile_cost_") if name.endswith("+rec") else None
        # torch.compile after the Recorder here; before it gives the same (tests/recorder/test_compile.py)
        self.rec = Recorder(self.model, self.run_dir, **json.loads(args.options)) if self.run_dir else None
        self.fwd = self.model
        if name.startswith("compiled"):
            self.fwd = torch.compile(self.model, **({"mode": args.mode} if args.mode else {}))
        self.times: list[float] = []
        self.graphs_at: list[int] = []  # steps at which this run made new graphs (one per graph)
        self.first_step_s = 0.0
        self.losses: list[torch.Tensor] = []

    def step(self, step: int, x, y) -> None:
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.fwd(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        if self.rec is not None:
            self.rec.step(loss=loss)
        else:
            loss.item()  # (the recorder reads the loss once a step; so does any loop that logs it)
        dt = time.perf_counter() - t0
        self.graphs_at += [step] * (counters["stats"]["unique_graphs"] - before)
        if step == 0:
            self.first_step_s = dt
        self.times.append(dt)
        self.losses.append(loss.detach())


def what_was_recorded(run_dir: str) -> str:
    with h5py.File(f"{run_dir}/rank0.h5", "r") as f:
        n = f["steps/loss"].shape[0]
        mods = f["modules/output_absmax"][:]
        measured = int((mods >= 0).any(axis=1).sum())
        grads = int(np.isfinite(f["params/grad_norm"][:]).all(axis=1).sum())
        fwd = int(np.isfinite(f["steps/forward_s"][:]).sum())
        sites = f["activity_sites/module"].shape[0]
    return (f"{n} steps: loss and gradient norms on {grads}, module outputs on {measured} (watched), "
            f"forward time on {fwd}, {sites} activation sites")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's default)")
    ap.add_argument("--steps", type=int, default=400, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--options", default="{}", help='Recorder options, JSON: \'{"blackbox": false}\'')
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False
    try:
        torch._functorch.config.enable_autograd_cache = False
    except AttributeError:
        pass
    names = [c for c in args.configs.split(",") if c]
    runs = [Run(name, args) for name in names]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g))
               for _ in range(8)]
    total = args.warmup + args.steps
    for step in range(total):
        x, y = batches[step % len(batches)]
        for k in range(len(runs)):  # the order rotates: no configuration always runs first
            runs[(step + k) % len(runs)].step(step, x, y)
    for r in runs:
        if r.rec is not None:
            r.rec.close()

    print(f"torch {torch.__version__}, MLP {args.depth} x {args.width}, batch {args.batch}, mode "
          f"{args.mode or 'default'}; {args.steps} steps timed after {args.warmup}, side by side")
    by = {r.name: r for r in runs}
    med = {r.name: statistics.median(r.times[args.warmup:]) for r in runs}
    mean = {r.name: statistics.fmean(r.times[args.warmup:]) for r in runs}
    print(f"{'config':<14}{'1st step s':>11}{'graphs':>8}{'after warm-up':>15}{'median ms':>11}"
          f"{'mean ms':>9}{'x bare':>8}")
    for r in runs:
        bare = "compiled" if r.name.startswith("compiled") else "eager"
        ratio = mean[r.name] / mean[bare] if bare in mean else float("nan")
        late = sum(1 for s in r.graphs_at if s >= args.warmup)
        print(f"{r.name:<14}{r.first_step_s:>11.2f}{len(r.graphs_at):>8}{late:>15}{med[r.name] * 1e3:>11.3f}"
              f"{mean[r.name] * 1e3:>9.3f}{ratio:>8.3f}")
    if "compiled" in by and "compiled+rec" in by:
        same = torch.equal(torch.stack(by["compiled"].losses), torch.stack(by["compiled+rec"].losses))
        print(f"compiled+rec / compiled, per step: median {med['compiled+rec'] / med['compiled']:.3f}, "
              f"mean {mean['compiled+rec'] / mean['compiled']:.3f}; losses bit-identical: {same}")
    if "eager" in by and "compiled" in by:
        print(f"compiled / eager, per step: mean {mean['compiled'] / mean['eager']:.3f}")
    for r in runs:
        if r.run_dir:
            print(f"{r.name} recorded: {what_was_recorded(r.run_dir)}")


if __name__ == "__main__":
    main()
