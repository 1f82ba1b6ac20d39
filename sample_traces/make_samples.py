"""Make the sample traces: small, real training runs, healthy and broken, recorded by torchautopsy.

    python sample_traces/make_samples.py [--out DIR] [--jobs N] [CASE ...]

Every case trains a small model on synthetic data generated here (no downloads) with the recorder
on (default options), and writes ``DIR/<case>/rank0.h5`` (DIR defaults to the folder of this
script). With no CASE, all cases run. The ground truth of every case goes to ``DIR/expected.json``
(case -> {"kind", "step", "where", "evidence"}); running a subset of cases updates only their entries.

Nothing is faked: each failure arises the way it does in real training, from the data, the
architecture or the hyper-parameters, and the numbers in the trace are what the recorder saw.

Each case runs in a process of its own (forked from this one, or spawned where fork is not
available), so that its memory readings and its allocator state do not depend on which cases ran
before it; with --jobs 2 two cases run side by side. Torch runs on one thread in each (on a shared
2-core machine, two threads per tiny model cost 10-20x more time than one, measured).

Everything is seeded (torch.manual_seed for the initial weights, torch.Generator for data and
batch order), so the same torch version on the same machine writes the same losses, bit for bit.
The losses are also bit-identical to the same loops without the recorder: the measurements that
fix a case's ground truth during training run on an unhooked twin of the model (sample_truth.Twin).
The script checks each trace after writing it (h5py only) and prints what it found; it exits
non-zero if a case did not come out as intended.

Cases (architecture; what goes wrong; how the ground truth "step" and "where" are fixed). The
README has the full table.

healthy_mlp, healthy_cnn_bn, healthy_transformer, healthy_gru, healthy_plateau
    Nothing goes wrong (the last one's loss flattens at its noise floor). kind: null.
exploding_lr (MLP), exploding_cnn (CNN without normalisation)
    A learning rate too high for the network. step: the first step whose total gradient norm
    exceeds 100x the median of steps 0-9 (measured from the trace); where: the parameters of the
    layer whose gradient norm grew most at that step, relative to its own steps 0-9.
vanishing_sigmoid (12-layer sigmoid MLP), vanishing_cnn_sigmoid (8-conv sigmoid CNN)
    Sigmoid derivatives (<= 1/4) compound over depth. step 0 (from initialisation on);
    where: the first layer's weight and bias.
nan_birth (MLP), nan_cnn_std (CNN), nan_attention_mask (transformer), nan_backward_sqrt (Siamese MLP)
    A bad record reaches an operation that is undefined on it. step: the step whose batch holds the
    record (by construction); where: the module whose forward holds the operation (by
    construction; checked against steps/nonfinite_origin), or for nan_backward_sqrt, whose forward
    stays finite, the parameters the backward pass reaches first.
dead_relu_lr (MLP), dead_relu_cnn_init (CNN, F.relu inside forward)
    ReLU units killed by the first large updates / born dead. step and where: measured on the
    whole training set with an unhooked twin of the model (see the functions).
attention_entropy_lr (nn.TransformerEncoder), attention_sink_mask (F.scaled_dot_product_attention)
    Entropy collapse after a learning rate 30x too high without warm-up; a key padding mask that
    leaves every query one key. step and where: measured with the twin / by construction.
leak_losses_mlp (MLP), leak_hook_gru (GRU)
    The training loop keeps every step's graph; a forward hook keeps every step's GRU outputs.
    step 0 (from the first iteration on, by construction).
oom_pairwise_mlp (MLP)
    A periodic retrieval metric builds an all-pairs tensor over a 2**20-item feature bank: the CPU
    allocator refuses the request and the job dies. step: the step it ran in (by construction).
ddp_straggler, ddp_hang (MLP under DDP, 4 ranks launched by torchrun, gloo; ddp_job.py)
    One rank's data loading slows down from a step / blocks at a step. step and rank: by
    construction (each case writes rank0.h5 ... rank3.h5).

The cases live in one module per family (cases_healthy, cases_gradients, cases_nonfinite,
cases_activity, cases_memory; their shared training loop in cases_common); this script holds the
registry (CASES, ARCHITECTURE, RUNNERS), the checks common to every trace and the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases_activity  # noqa: E402
import cases_gradients  # noqa: E402
import cases_healthy  # noqa: E402
import cases_memory  # noqa: E402
import cases_nonfinite  # noqa: E402
import cases_ranks  # noqa: E402
from sample_truth import EXPLODE_BASELINE_STEPS, EXPLODE_FACTOR, read_trace  # noqa: E402

CASES = (
    "healthy_mlp", "healthy_cnn_bn", "healthy_transformer", "healthy_gru", "healthy_plateau",
    "exploding_lr", "exploding_cnn",
    "vanishing_sigmoid", "vanishing_cnn_sigmoid",
    "nan_birth", "nan_cnn_std", "nan_attention_mask", "nan_backward_sqrt",
    "dead_relu_lr", "dead_relu_cnn_init",
    "attention_entropy_lr", "attention_sink_mask",
    "leak_losses_mlp", "leak_hook_gru",
    "oom_pairwise_mlp",
    "ddp_straggler", "ddp_hang",
)
ARCHITECTURE = {
    "healthy_mlp": "MLP", "healthy_cnn_bn": "CNN + BatchNorm", "healthy_transformer": "transformer encoder",
    "healthy_gru": "GRU", "healthy_plateau": "MLP", "exploding_lr": "MLP", "exploding_cnn": "CNN",
    "vanishing_sigmoid": "MLP", "vanishing_cnn_sigmoid": "CNN", "nan_birth": "MLP", "nan_cnn_std": "CNN",
    "nan_attention_mask": "transformer encoder (hand-written attention)", "nan_backward_sqrt": "Siamese MLP", "dead_relu_lr": "MLP",
    "dead_relu_cnn_init": "CNN (F.relu in forward)", "attention_entropy_lr": "transformer encoder (nn.TransformerEncoder)",
    "attention_sink_mask": "transformer encoder (F.scaled_dot_product_attention)", "leak_losses_mlp": "MLP",
    "leak_hook_gru": "GRU", "oom_pairwise_mlp": "MLP",
    "ddp_straggler": "MLP, DDP on 4 ranks", "ddp_hang": "MLP, DDP on 4 ranks",
}


def step_tolerance(kind, step) -> int:
    """How far the analyzer's step may be from the true one, given how the data is sampled:
    per-unit activity is recorded in windows (5, 10, 20, 40 steps, then 50: a death is known to
    the window), attention on watched steps (every 10th in the first 100 steps, then up to 50
    apart: these small models' watched steps cost more than the recorder's 0.5% budget), and a
    leak's onset is estimated from a noisy line."""
    if kind == "dead_relu":
        start, length = 0, 5
        while start + length <= step:
            start, length = start + length, min(50, length * 2)
        return length
    if kind == "attention_collapse":
        return 10 if step < 100 else 50
    return {"memory_leak": 10}.get(kind, 0)


# -- driver -------------------------------------------------------------------------------------

def _check_common(case: str, run_dir: str) -> None:
    t = read_trace(run_dir)
    n = len(t["step"])
    if not np.array_equal(t["step"], np.arange(n)):
        raise SystemExit(f"{case}: steps/step is not 0..{n - 1}")
    if len(t["grad_norm"]) != n:
        raise SystemExit(f"{case}: params has {len(t['grad_norm'])} rows, steps has {n}")
    dropped = int(t["attrs"].get("dropped_steps", 0)) + int(t["attrs"].get("dropped_rows", 0))
    if dropped:
        raise SystemExit(f"{case}: the recorder dropped {dropped} steps")
    size = os.path.getsize(os.path.join(run_dir, "rank0.h5"))
    if size > 3_000_000:  # two snapshots of the model (steps 0 and the end) included
        raise SystemExit(f"{case}: the trace is {size / 1e6:.2f} MB, over 3 MB")
    finite = np.isfinite(t["loss"])
    print(f"  {n} steps, {size / 1e6:.2f} MB, loss {t['loss'][0]:.4g} -> "
          f"{t['loss'][finite][-1] if finite.any() else float('nan'):.4g} (last finite), "
          f"non-finite losses: {int((~finite).sum())}")
    if case.startswith("healthy"):
        total = np.sqrt(np.sum(t["grad_norm"].astype(np.float64) ** 2, axis=1))
        base = np.median(total[:EXPLODE_BASELINE_STEPS])
        print(f"  total grad norm / median of steps 0-9: min {total.min() / base:.2f}, max {total.max() / base:.2f}")
        if not finite.all() or (t["nonfinite_origin"] >= 0).any() or total.max() > 0.5 * EXPLODE_FACTOR * base:
            raise SystemExit(f"{case} is not healthy")


# Each case is the function of its name in one of the family modules.
_FAMILIES = (cases_healthy, cases_gradients, cases_nonfinite, cases_activity, cases_memory, cases_ranks)
_FUNCTIONS = {name: obj for family in _FAMILIES for name, obj in vars(family).items()}
RUNNERS = {name: _FUNCTIONS[name] for name in CASES}


def _run_case(job):
    """Run one case (in a worker process); returns (case, entry or None, log, seconds)."""
    case, out = job
    torch.set_num_threads(1)
    run_dir = os.path.join(out, case)
    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    buf = io.StringIO()
    t0 = time.perf_counter()
    entry = None
    with contextlib.redirect_stdout(buf):
        try:
            entry = RUNNERS[case](run_dir)
            entry = {"kind": entry["kind"], "step": entry["step"], "where": entry["where"],
                     "step_tolerance": step_tolerance(entry["kind"], entry["step"]),
                     "evidence": {"architecture": ARCHITECTURE[case], **entry["evidence"]}}
            _check_common(case, run_dir)
            print(f"  -> {os.path.join(run_dir, 'rank0.h5')}")
        except SystemExit as e:
            print(f"  FAILED: {e}")
            entry = None
        except Exception:
            print("  FAILED:\n" + traceback.format_exc())
            entry = None
    return case, entry, buf.getvalue(), time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                   help="folder for the run directories and expected.json (default: this script's folder)")
    p.add_argument("--jobs", type=int, default=2, help="cases run side by side (default 2)")
    p.add_argument("cases", nargs="*", metavar="CASE", help=f"cases to make (default: all): {', '.join(CASES)}")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    cases = args.cases or list(CASES)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    exp_path = os.path.join(out, "expected.json")
    expected = {}
    if os.path.exists(exp_path):
        with open(exp_path) as f:
            expected = json.load(f)
    torch.set_num_threads(1)
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    t_all = time.perf_counter()
    failed = []
    with ctx.Pool(processes=max(1, args.jobs), maxtasksperchild=1) as pool:
        for case, entry, log, secs in pool.imap(_run_case, [(c, out) for c in cases]):
            print(f"{case}:\n{log.rstrip()}\n  ({secs:.1f} s)", flush=True)
            if entry is None:
                failed.append(case)
            else:
                expected[case] = entry
    expected = {c: expected[c] for c in CASES if c in expected} | {c: v for c, v in expected.items() if c not in CASES}
    with open(exp_path, "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    print(f"wrote {exp_path}; total {time.perf_counter() - t_all:.1f} s")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
