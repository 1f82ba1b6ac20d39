"""Write a large synthetic trace in the real format, to measure the analyzer at scale.

    python benchmarks/synthetic_trace.py OUT_DIR --steps 1000000 --params 200 [--modules 200]
                                         [--explode-at STEP]

The layout, dtypes and chunking are the recorder's own (recorder/trace_file/writer.py writes it);
only the numbers are made up, with the schedules the recorder's defaults give such a model (100
Linear 256x256 layers with ReLUs: its budgets, recorder/config.py): a run whose gradient norms
wander around a per-layer level, loss decaying with noise, memory flat; watched steps (module
outputs, activations, attention, max |g|, weight norms) every 10 steps in the first 100, then every
50th; update ratios every 10 steps, then every 70th; ReLU activity windows of 5, 10, 20, 40, then 50
steps; a tensor census every 900 steps; fingerprints every 100; a profiler window every 1,000 steps.
With --explode-at, the first layers' gradients grow from that step on, the loss follows, and both go
NaN 300 steps later (so the analyzer and the report have findings to draw at scale). No torch model
is trained, so a million steps take a minute, not a day. Then time the analyzer, for example:

    /usr/bin/time -v torchautopsy analyze OUT_DIR --json f.json --html r.html
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time

import numpy as np

from torchautopsy import trace_schema
from torchautopsy.recorder.trace_file.schema import FORMAT_NAME, SCHEMA_VERSION, table_layout
from torchautopsy.recorder.trace_file.writer import TraceWriter

BLOCK = 20_000  # steps generated and written at a time: memory stays bounded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--modules", type=int, default=None, help="default: as many as parameters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levels-seed", type=int, default=None,
                    help="draw the layers' levels from this seed, the noise from --seed (default: --seed)")
    ap.add_argument("--explode-at", type=int, default=None, help="step where gradients start to explode")
    a = ap.parse_args()
    write(a.out_dir, a.steps, a.params, a.modules or a.params, a.seed, a.explode_at, a.levels_seed)


# The recorder's default schedules (recorder/config.py) as its budgets space them on this model
# (benchmarks/README.md, "What the defaults cost"; a real recording of the model under the
# Recorder watched steps 0-100 every 10, then every 50): every SAMPLE_EVERY steps in the first
# WARMUP, then watched steps every WATCH_GAP, update ratios every UPDATE_GAP, a census every
# CENSUS_EVERY (its ~50 ms within 0.15% of the step).
SAMPLE_EVERY, WARMUP, WATCH_GAP, UPDATE_GAP = 10, 100, 50, 70
ACTIVITY_WINDOW, CENSUS_EVERY, PROFILE_EVERY, FINGERPRINT_EVERY = 50, 900, 1000, 100
RELU_UNITS = 256  # units of each ReLU site (one after every other module)
HEADS, ATTENTION_SITES = 4, 4
CENSUS_GROUPS = 12
PROFILE_OPS = 60
NAN_AFTER = 300  # steps from the start of an explosion to NaN


def write(out_dir: str, n_steps: int, n_params: int, n_modules: int, seed: int = 0,
          explode_at: int | None = None, levels_seed: int | None = None) -> str:
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
             "config": json.dumps({"activations_every": SAMPLE_EVERY, "update_ratio_every": SAMPLE_EVERY,
                                 "attention_every": SAMPLE_EVERY, "activity_window": ACTIVITY_WINDOW,
                                 "census_every": 50, "profile_every": PROFILE_EVERY,
                                 "fingerprint_every": FINGERPRINT_EVERY}), "command": "",
             "closed": False}
    static = {
        "params": {"name": (params, "str"), "shape": ([json.dumps(s) for s in shapes], "str"),
                   "numel": ([int(np.prod(s)) for s in shapes], "i8"), "dtype": (["float32"] * n_params, "str")},
        "modules": {"name": (modules, "str"), "type": (["Linear"] * n_modules, "str"),
                    "is_leaf": ([0] + [1] * (n_modules - 1), "i8")},
    }
    w = TraceWriter(path, attrs, static, table_layout(n_params, n_modules), flush_every_s=3600.0,
                    write_every_steps=1 << 30, queue_size=16)
    # Each parameter's typical gradient and weight norm: one model, whatever the noise's seed.
    lrng = rng if levels_seed is None else np.random.default_rng(levels_seed)
    level = 10 ** lrng.uniform(-3, 0, n_params)
    weight = 10 ** lrng.uniform(0, 1.5, n_params)
    relu_modules = list(range(1, n_modules, 2))
    w.write_columns("activity_sites", {
        "module": np.array(relu_modules), "function": np.array(["relu"] * len(relu_modules), dtype=object),
        "call": np.zeros(len(relu_modules)), "param": np.full(len(relu_modules), np.nan),
        "unit_dim": np.ones(len(relu_modules)), "units": np.full(len(relu_modules), RELU_UNITS),
        "bit_offset": np.arange(len(relu_modules)) * RELU_UNITS, "first_step": np.zeros(len(relu_modules))})
    att_modules = relu_modules[:ATTENTION_SITES]
    w.write_columns("attention_sites", {
        "module": np.array(att_modules), "source": np.array(["MultiheadAttention"] * len(att_modules), dtype=object),
        "call": np.zeros(len(att_modules)), "heads": np.full(len(att_modules), HEADS),
        "head_offset": np.arange(len(att_modules)) * HEADS, "first_step": np.zeros(len(att_modules))})
    w.write_columns("module_outputs", {"module": np.arange(n_modules),
                                       "shape": np.array(["[64, 256]"] * n_modules, dtype=object),
                                       "dtype": np.array(["float32"] * n_modules, dtype=object),
                                       "grad_fn": np.array(["AddmmBackward0"] * n_modules, dtype=object)})
    trace_blob = gzip.compress(json.dumps({"traceEvents": [
        {"name": f"aten::op{i}", "ph": "X", "ts": i * 10, "dur": 5, "pid": 0, "tid": 0}
        for i in range(PROFILE_OPS)]}).encode())
    window = 0
    # Explosion: the first third of the parameters' gradients grow 3% a step, then go NaN.
    early = np.arange(n_params) < max(1, n_params // 3)
    t0 = time.perf_counter()
    for start in range(0, n_steps, BLOCK):
        n = min(BLOCK, n_steps - start)
        steps = np.arange(start, start + n)
        f32 = np.float32
        growth = np.ones(n)
        broken = np.zeros(n, dtype=bool)
        if explode_at is not None:
            since = steps - explode_at
            growth = np.where(since > 0, np.exp(0.03 * np.clip(since, 0, NAN_AFTER)), 1.0)
            broken = since >= NAN_AFTER
        loss = 2.0 / (1 + steps / 1e4) + 0.05 * rng.random(n)
        loss = np.where(broken, np.nan, loss * np.sqrt(growth))
        census = np.where(steps % CENSUS_EVERY == 0, 5000, -1)
        watched = _every(steps, WATCH_GAP) | broken
        sampled_update = _every(steps, UPDATE_GAP)
        # What the run measures; every other column holds its "not measured" (trace_schema.py).
        w.write_columns("steps", {
            **{c.name: np.full(n, c.fill) for c in trace_schema.columns("steps") if c.fill is not None},
            "step": steps, "time_s": now + 0.05 * steps, "loss": loss, "loss_given": np.ones(n),
            "rss_bytes": np.full(n, 2 << 30),
            "between_steps_s": np.full(n, 0.002, f32), "forward_s": np.full(n, 0.015, f32),
            "backward_s": np.full(n, 0.03, f32), "recorder_s": np.full(n, 0.001, f32),
            "gc_s": np.full(n, 0.0, f32), "gc_gen2": np.zeros(n), "lr": np.full(n, 1e-3), "optimizer_steps": np.ones(n),
            "grads_kept": np.zeros(n), "train_mode": np.ones(n), "nograd_train_forwards": np.zeros(n),
            # NaN is born in the forward pass of module 1 at the first broken step.
            "nonfinite_origin": np.where(broken & (steps == (explode_at or 0) + NAN_AFTER), 1, -1),
            "live_tensors": census, "live_tensor_bytes": np.where(census > 0, 1 << 30, -1),
            "live_tensors_with_graph": np.where(census > 0, 0, -1),
        })
        g = level * np.exp(0.3 * rng.standard_normal((n, n_params)))
        g[:, early] *= growth[:, None]
        g[broken] = np.nan
        g = g.astype(f32)
        # As the recorder measures them: max|g|, weight norms and module outputs on watched steps
        # and on bad steps (weight norms also on the step before an update ratio); -1 (not
        # measured) on the others.
        w_measured = watched | _every(steps + 1, UPDATE_GAP)
        w.write_columns("params", {
            "grad_norm": g, "grad_absmax": np.where(watched[:, None], g * 0.1, -1).astype(f32),
            "grad_nonfinite": np.where(broken[:, None], 1000, 0).astype(np.int32) * np.ones((1, n_params), np.int32),
            "param_norm": np.where(broken[:, None], np.nan,
                                   np.where(w_measured[:, None], np.broadcast_to(weight, (n, n_params)), -1)).astype(f32),
        })
        out = rng.uniform(0.5, 5, (n, n_modules))
        out[broken] = np.nan
        out[~watched] = -1
        w.write_columns("modules", {"output_absmax": out.astype(f32)})
        _periodic(w, rng, steps, n_modules, len(relu_modules), len(att_modules), census, now)
        while window * PROFILE_EVERY + 10 < start + n:
            a = window * PROFILE_EVERY + 10
            w.write_columns("profile_windows", {"window": np.array([window]), "step_start": np.array([a]),
                                                "step_end": np.array([a + 1]),
                                                "trace_offset": np.array([w.append_blob(np.frombuffer(trace_blob, np.uint8))]),
                                                "trace_nbytes": np.array([len(trace_blob)]),
                                                "exported_unix": np.array([now + a + 2.0])})
            w.write_columns("profile_ops", {
                "window": np.full(PROFILE_OPS, window), "name": np.array([f"aten::op{i}" for i in range(PROFILE_OPS)], dtype=object),
                "calls": np.full(PROFILE_OPS, 20), "cpu_self_us": rng.uniform(10, 5000, PROFILE_OPS),
                "cpu_total_us": rng.uniform(10, 9000, PROFILE_OPS), "device_self_us": np.zeros(PROFILE_OPS),
                "device_total_us": np.zeros(PROFILE_OPS), "cpu_memory_bytes": np.zeros(PROFILE_OPS),
                "device_memory_bytes": np.zeros(PROFILE_OPS)})
            window += 1
        sampled = steps[_every(steps, WATCH_GAP)]
        k = len(sampled)
        if k:
            w.write_columns("activations", {
                "step": sampled, "mean": rng.normal(0, 0.1, (k, n_modules)).astype(f32),
                "std": rng.uniform(0.5, 1.5, (k, n_modules)).astype(f32),
                "absmax": rng.uniform(1, 5, (k, n_modules)).astype(f32),
                "zero_frac": rng.uniform(0.3, 0.6, (k, n_modules)).astype(f32),
                "nonfinite": np.zeros((k, n_modules), np.int32)})
            w.write_columns("attention", {
                "step": sampled, "entropy": rng.uniform(0.6, 0.9, (k, HEADS * len(att_modules))).astype(f32),
                "max_weight": rng.uniform(0.1, 0.3, (k, HEADS * len(att_modules))).astype(f32),
                "sink_share": rng.uniform(0.1, 0.3, (k, HEADS * len(att_modules))).astype(f32),
                "head_similarity": rng.uniform(0.2, 0.5, (k, len(att_modules))).astype(f32),
                "keys": np.full((k, len(att_modules)), 64, np.int32)})
        updated = steps[sampled_update]
        if len(updated):
            w.write_columns("updates", {"step": updated, "ratio": (
                1e-3 * np.exp(0.3 * rng.standard_normal((len(updated), n_params)))).astype(f32)})
        fp = steps[steps % FINGERPRINT_EVERY == 0]
        if len(fp):  # each parameter's bits summed (distributed/fingerprint.py): one int64 a parameter
            w.write_columns("fingerprints", {"step": fp, "bits": rng.integers(-2**62, 2**62, (len(fp), n_params))})
        print(f"\r{start + n:,} / {n_steps:,} steps ({time.perf_counter() - t0:.0f} s)", end="", flush=True)
    w.close({"closed": True, "end_reason": "closed", "end_unix": now + 0.05 * n_steps, "n_steps_recorded": n_steps})
    print(f"\nwrote {path}: {os.path.getsize(path) / 2**20:,.0f} MiB")
    return path


def _every(steps: np.ndarray, gap: int) -> np.ndarray:
    """Steps of a budgeted schedule: every SAMPLE_EVERY-th in the warm-up, then every gap-th."""
    return np.where(steps < WARMUP, steps % SAMPLE_EVERY == 0, steps % gap == 0)


# The first activity windows' last steps (5, 10, 20 and 40 steps long: forward/unit_activity.py), then every
# ACTIVITY_WINDOW-th step ends one.
_FIRST_ENDS = np.array([4, 14, 34, 74])


def _window_ends(steps: np.ndarray) -> np.ndarray:
    later = (steps > _FIRST_ENDS[-1]) & ((steps - _FIRST_ENDS[-1]) % ACTIVITY_WINDOW == 0)
    return np.isin(steps, _FIRST_ENDS) | later


def _periodic(w, rng, steps, n_modules, n_relu, n_att, census, now) -> None:
    """The windowed and sampled tables: activity windows, the tensor census."""
    ends = steps[_window_ends(steps)]
    k = len(ends)
    if k:
        starts = np.array([_window_start(e) for e in ends])
        seen = np.array([int(_every(np.arange(a, e + 1), WATCH_GAP).sum()) for a, e in zip(starts, ends)], np.int32)
        # Each unit fired at least once in a window (healthy), but for a few per site.
        bits = np.ones((k, n_relu * RELU_UNITS), dtype=bool)
        bits[:, ::97] = False
        w.write_columns("activity", {
            "step_start": starts, "step_end": ends,
            "steps_seen": np.repeat(seen[:, None], n_relu, axis=1),
            "steps_watched": seen,
            "ever_positive": np.packbits(bits, axis=1, bitorder="little"),
            "saturated_frac": np.zeros((k, n_relu), np.float32)})
    at = steps[census > 0]
    if len(at):
        m = len(at) * CENSUS_GROUPS
        w.write_columns("census_groups", {
            "step": np.repeat(at, CENSUS_GROUPS), "device": np.array(["cpu"] * m, dtype=object),
            "dtype": np.array(["float32"] * m, dtype=object),
            "shape": np.array([f"[{256 * (i + 1)}, 256]" for i in range(CENSUS_GROUPS)] * len(at), dtype=object),
            "graph": np.zeros(m), "count": np.full(m, 4), "bytes": np.tile(np.arange(1, CENSUS_GROUPS + 1) << 20, len(at)),
            "grad_fn": np.array([""] * m, dtype=object)})


def _window_start(end: int) -> int:
    k = int(np.searchsorted(_FIRST_ENDS, end))
    if k < len(_FIRST_ENDS):
        return 0 if k == 0 else int(_FIRST_ENDS[k - 1]) + 1
    return end - ACTIVITY_WINDOW + 1


if __name__ == "__main__":
    main()
