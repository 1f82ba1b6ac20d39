"""Write a large synthetic trace in the real format, to measure the analyzer at scale.

    python benchmarks/synthetic_trace.py OUT_DIR --steps 1000000 --params 200 [--modules 200]

The layout, dtypes and chunking are the recorder's own (recorder/writer.py writes it); only the
numbers are made up: a healthy run whose gradient norms wander around a per-layer level, loss
decaying with noise, memory flat, activations sampled every 10 steps. No torch model is trained,
so a million steps take a minute, not a day. Then time the analyzer, for example:

    /usr/bin/time -v torchautopsy analyze OUT_DIR --json f.json --html r.html
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from torchautopsy.recorder.writer import FORMAT_NAME, SCHEMA_VERSION, TraceWriter, table_layout

BLOCK = 20_000  # steps generated and written at a time: memory stays bounded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--modules", type=int, default=None, help="default: as many as parameters")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write(a.out_dir, a.steps, a.params, a.modules or a.params, a.seed)


def write(out_dir: str, n_steps: int, n_params: int, n_modules: int, seed: int = 0) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "rank0.h5")
    rng = np.random.default_rng(seed)
    params = [f"layers.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n_params)]
    shapes = [[256, 256] if i % 2 == 0 else [256] for i in range(n_params)]
    modules = [""] + [f"layers.{i}" for i in range(n_modules - 1)]
    now = time.time()
    attrs = {"format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "created_by": "synthetic_trace.py",
             "torch_version": "synthetic", "python_version": "", "host": "synthetic", "pid": 0, "rank": 0,
             "world_size": 1, "start_time": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now)),
             "start_unix": now, "device": "cpu", "model_class": "Synthetic", "model_summary": "synthetic",
             "n_parameters": int(sum(np.prod(s) for s in shapes)),
             "config": json.dumps({"activations_every": 10, "update_ratio_every": 10}), "command": "",
             "closed": False}
    static = {
        "params": {"name": (params, "str"), "shape": ([json.dumps(s) for s in shapes], "str"),
                   "numel": ([int(np.prod(s)) for s in shapes], "i8"), "dtype": (["float32"] * n_params, "str")},
        "modules": {"name": (modules, "str"), "type": (["Linear"] * n_modules, "str"),
                    "is_leaf": ([0] + [1] * (n_modules - 1), "i8")},
    }
    w = TraceWriter(path, attrs, static, table_layout(n_params, n_modules), flush_every_s=3600.0,
                    write_every_steps=1 << 30, queue_size=16)
    level = 10 ** rng.uniform(-3, 0, n_params)  # each parameter's typical gradient norm
    weight = 10 ** rng.uniform(0, 1.5, n_params)
    t0 = time.perf_counter()
    for start in range(0, n_steps, BLOCK):
        n = min(BLOCK, n_steps - start)
        steps = np.arange(start, start + n)
        f32 = np.float32
        w.write_columns("steps", {
            "step": steps, "time_s": now + 0.05 * steps, "loss": 2.0 / (1 + steps / 1e4) + 0.05 * rng.random(n),
            "rss_bytes": np.full(n, 2 << 30), "cuda_allocated_bytes": np.full(n, -1),
            "cuda_reserved_bytes": np.full(n, -1), "cuda_peak_bytes": np.full(n, -1),
            "between_steps_s": np.full(n, 0.002, f32), "data_wait_s": np.full(n, np.nan, f32),
            "forward_s": np.full(n, 0.015, f32), "backward_s": np.full(n, 0.03, f32),
            "recorder_s": np.full(n, 0.001, f32), "nonfinite_origin": np.full(n, -1),
            "batch_nonfinite": np.zeros(n), "live_tensors": np.full(n, -1),
            "live_tensor_bytes": np.full(n, -1), "live_tensors_with_graph": np.full(n, -1),
        })
        g = (level * np.exp(0.3 * rng.standard_normal((n, n_params)))).astype(f32)
        w.write_columns("params", {
            "grad_norm": g, "grad_absmax": (g * 0.1).astype(f32),
            "grad_nonfinite": np.zeros((n, n_params), np.int32),
            "param_norm": np.broadcast_to(weight, (n, n_params)).astype(f32),
        })
        w.write_columns("modules", {"output_absmax": rng.uniform(0.5, 5, (n, n_modules)).astype(f32)})
        sampled = steps[steps % 10 == 0]
        k = len(sampled)
        if k:
            w.write_columns("activations", {
                "step": sampled, "mean": rng.normal(0, 0.1, (k, n_modules)).astype(f32),
                "std": rng.uniform(0.5, 1.5, (k, n_modules)).astype(f32),
                "absmax": rng.uniform(1, 5, (k, n_modules)).astype(f32),
                "zero_frac": rng.uniform(0.3, 0.6, (k, n_modules)).astype(f32),
                "nonfinite": np.zeros((k, n_modules), np.int32)})
            w.write_columns("updates", {"step": sampled,
                                        "ratio": (1e-3 * np.exp(0.3 * rng.standard_normal((k, n_params)))).astype(f32)})
        print(f"\r{start + n:,} / {n_steps:,} steps ({time.perf_counter() - t0:.0f} s)", end="", flush=True)
    w.close({"closed": True, "end_reason": "closed", "end_unix": now + 0.05 * n_steps, "n_steps_recorded": n_steps})
    print(f"\nwrote {path}: {os.path.getsize(path) / 2**20:,.0f} MiB")
    return path


if __name__ == "__main__":
    main()
