"""memory_leak: resident memory (or CUDA allocated) growing along a straight line after the
warm-up, or tensors holding an autograd graph piling up in the census."""

import numpy as np
import pytest

from tests.tracebuilder import TraceBuilder, findings

KIND = "memory_leak"
MIB = 2**20
GIB = 2**30


def run(rss, steps=100) -> TraceBuilder:
    return TraceBuilder.mlp(layers=3, steps=steps).loss(1.0).total_grad_norm(1.0).set("steps/rss_bytes", rss)


def test_steady_growth_from_step_40(tmp_path):
    i = np.arange(100)
    run(GIB + 3 * MIB * np.maximum(i - 40, 0)).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    # Dated where memory first stood above its warm-up level by more than 5% of the growth (171 MiB
    # from the first to the last 5 judged steps): 9 MiB at step 43.
    assert (f.severity, f.step, f.where) == ("warning", 43, [])
    assert f.evidence["series"] == "rss_bytes"
    assert abs(f.evidence["bytes_per_step"] - 3 * MIB) < 0.5 * MIB  # the fit over steps 20-99, hinge included


def test_leak_from_the_first_step_names_the_kept_tensors(tmp_path):
    b = run(GIB + 2 * MIB * np.arange(100))
    b.set("steps/live_tensors", [100 + s for s in range(0, 100, 10)], at=range(0, 100, 10))
    b.set("steps/live_tensor_bytes", [2 * MIB * s for s in range(0, 100, 10)], at=range(0, 100, 10))
    b.set("steps/live_tensors_with_graph", 1, at=range(0, 100, 10))
    for s in range(0, 100, 10):
        b.census(s, count=s, bytes=2 * MIB * s, shape="[512, 1024]")
    b.row("module_outputs", module="2", shape="[512, 1024]", dtype="float32", grad_fn="AddmmBackward0")
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 0, ["2"])
    assert f.evidence["growing_group"]["shape"] == "[512, 1024]" and "hook" in f.summary


def test_memory_hiding_a_leak_the_census_saw_from_the_start_is_dated_by_the_census(tmp_path):
    # The allocator reuses freed pages: resident memory stays flat until step 45, while the census
    # counts the kept tensors growing by one a step from step 0 (censuses at 0, 12, 53, 89: the
    # recorder's budget spaces them). Dated where the census's count runs back to its start.
    i = np.arange(100)
    b = run(GIB + 2 * MIB * np.maximum(i - 45, 0))
    census = [0, 12, 53, 89]
    b.set("steps/live_tensors_with_graph", 1, at=census)
    for s in census:
        b.census(s, count=1 + s, bytes=2 * MIB * (1 + s), shape="[64, 50, 128]")
    b.row("module_outputs", module="2", shape="[64, 50, 128]", dtype="float32", grad_fn="")
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where) == (0, ["2"])
    assert (f.evidence["growing_group"]["grown_by_step"], f.evidence["growing_group"]["started_about_step"]) == (12, 0)


def test_kept_losses_with_their_graph_while_memory_is_flat(tmp_path):
    b = run(GIB)
    census = list(range(0, 100, 10))
    b.set("steps/live_tensors_with_graph", [1 + s for s in census], at=census)
    for s in census:
        b.census(s, count=1 + s, bytes=4 * (1 + s), graph=1, grad_fn="MseLossBackward0")
    b.write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 0, [])  # the last census at the group's smallest count
    assert f.evidence["series"] == "live_tensors_with_graph" and f.evidence["tensors_with_graph_per_step"] == 1.0


def test_cuda_allocated_memory_is_judged_before_resident_memory(tmp_path):
    b = run(3 * GIB).set("steps/cuda_allocated_bytes", GIB + 4 * MIB * np.arange(100))
    b.set("steps/cuda_reserved_bytes", 2 * GIB).set("steps/cuda_peak_bytes", 2 * GIB).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.evidence["series"]) == ("warning", 0, "cuda_allocated_bytes")
    assert f.evidence["bytes_per_step"] == pytest.approx(4 * MIB)


def test_caching_allocator_reserving_more_is_no_leak(tmp_path):
    b = run(3 * GIB).set("steps/cuda_allocated_bytes", GIB).set("steps/cuda_peak_bytes", GIB)
    b.set("steps/cuda_reserved_bytes", GIB + 4 * MIB * np.arange(100)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_warm_up_growth_that_plateaus_is_quiet(tmp_path):
    i = np.arange(100)
    run(GIB + 2 * MIB * np.minimum(i, 50)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_a_one_off_jump_is_quiet(tmp_path):
    run(GIB + 300 * MIB * (np.arange(100) >= 60)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_growth_under_the_thresholds_is_quiet(tmp_path):
    run(GIB + 0.1 * MIB * np.arange(100)).write(tmp_path)  # 8 MiB over the run: allocator noise
    assert findings(tmp_path, KIND) == []


def test_memory_not_measured(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).write(tmp_path)  # rss_bytes -1 (rss_source "none")
    assert findings(tmp_path, KIND) == []


def test_run_too_short_to_judge(tmp_path):
    run(GIB + 10 * MIB * np.arange(20), steps=20).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_trace_without_resident_memory_is_not_checked(tmp_path):
    run(GIB + 2 * MIB * np.arange(100)).without("steps/rss_bytes").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, [])
    assert f.evidence["lacking"] == ["steps/rss_bytes"]
