"""Issue 25: what the recorder adds to a step, counted in ATen ops (benchmarks/op_counts.py), which
on a GPU are kernel launches. Counts, not times: the same on any machine. The GPU's path (fused
reductions) is counted on the CPU with fused_reductions=True, the ops a GPU would dispatch.

Ceilings: a watched step adds at most 25% of the bare step's ops, a plain step a few."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import op_counts  # noqa: E402

# Each workload's batches cut to their first samples (benchmarks/op_counts.py's build): the ops a
# step dispatches do not depend on the batch's size, their work does (the CNN's convolutions were
# most of its 13 CPU-s). Cut to no fewer samples than keep every tensor the recorder reduces over
# its CPU sample (65,536 elements), so the same ones are sliced as at full size: every kind's ops,
# by name, counted equal to the full batches' (2026-11-29; but for the live-tensor census, which
# is timed: a budget of the training time, asserted nothing here).
BATCH = {"transformer": 2, "mlp": 136, "cnn": 24}
WATCHED_SHARE = 0.25  # the ceiling, of the bare step's op count
PLAIN_OPS = 10  # a few foreach ops, a stack and the step's one transfer


@pytest.mark.parametrize("workload", op_counts.WORKLOADS)
def test_a_watched_step_adds_at_most_a_quarter_of_the_bare_step(workload):
    from torchautopsy.recorder.forward.input_stats import CPU_ELEMENTS

    # (a float batch sliced to the recorder's sample at full size still is: the same ops)
    full, cut = op_counts.build(workload)[3][0][0], op_counts.build(workload, BATCH[workload])[3][0][0]
    assert not full.is_floating_point() or (cut.numel() > CPU_ELEMENTS) == (full.numel() > CPU_ELEMENTS)
    r = op_counts.measure(workload, steps=32, fused=True, batch=BATCH[workload])  # watched: 20, 30 (10: a profiler window)
    bare = r["bare"]
    assert bare > 200  # (a counter that saw nothing would pass any ceiling)
    watched, plain = r["kinds"]["watched"], r["kinds"]["plain"]
    assert watched["steps"] >= 2 and plain["steps"] >= 10
    assert watched["added"] <= WATCHED_SHARE * bare, (workload, watched["added"], bare, watched["ops"])
    assert 0 < plain["added"] <= PLAIN_OPS, (workload, plain["ops"])
    # per-module work is fused: the per-tensor path's ops are gone (one norm: the heads' similarity)
    # a fingerprint step: one integer sum per parameter (and its view), a few ops to pack them
    fp = r["kinds"]["fingerprint"]
    n_params = op_counts.n_params(workload)
    assert fp["steps"] >= 1 and fp["added_compute"] <= plain["added_compute"] + n_params + 12, (workload, fp["ops"])
    assert fp["ops"].get("sum", 0) == n_params, fp["ops"]
    per_tensor = {op: watched["ops"].get(op, 0) for op in ("aminmax", "linalg_vector_norm", "dot", "sign", "select")}
    assert max(per_tensor.values()) <= 1, per_tensor
