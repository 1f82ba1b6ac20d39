"""l2_norms: the recorder's gradient and weight norms (on a CPU with several threads, a BLAS dot per
tensor for lists of large tensors; otherwise one _foreach_norm), checked against float64 norms,
in the tensors' order; and l2_norm_values, the same norms read to the host as Python floats (the
optimizer step pre-hook's, every step)."""

from __future__ import annotations

import math

import pytest
import torch

from torchautopsy.recorder.reductions.stats import DOT_MEAN_ELEMENTS, l2_norm_values, l2_norms


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _reference(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.detach().double()).item()


def _ops(tensors) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        l2_norms(tensors)
    return {e.key for e in prof.key_averages()}


def _large(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(512, 512, generator=g), torch.randn(512, generator=g) * 5.0,
            torch.randn(256, 256, generator=g, dtype=torch.float64) * 1e3,
            torch.randn(64, 64, 16, generator=g) * 1e-20]


def test_large_tensors_take_dots_with_threads_and_match_float64(threads):
    tensors = _large(0)
    assert sum(t.numel() for t in tensors) >= DOT_MEAN_ELEMENTS * len(tensors)
    got = l2_norms(tensors).tolist()
    assert got == pytest.approx([_reference(t) for t in tensors], rel=1e-5, abs=1e-30)
    values = l2_norm_values(tensors)
    assert type(values) is list and all(type(v) is float for v in values)
    assert values == pytest.approx(got, rel=1e-6, abs=1e-30)
    ops = _ops(tensors)
    if threads > 1:
        assert "aten::dot" in ops and "aten::_foreach_norm" not in ops
    else:
        assert "aten::_foreach_norm" in ops and "aten::dot" not in ops


def test_other_lists_take_foreach_norm_in_order(threads):
    g = torch.Generator().manual_seed(1)
    mixed = _large(2) + [
        torch.randn(300, 200, generator=g).t(),  # not contiguous
        torch.randn(40_000, generator=g).bfloat16(),  # another dtype
        torch.zeros(0),  # empty
    ]
    small = [torch.randn(7, generator=g), torch.randn(30, 30, generator=g)]
    for tensors in (mixed, small):
        got = l2_norms(tensors)
        assert got.shape == (len(tensors),)
        for k, t in enumerate(tensors):
            rel = 1e-2 if t.dtype == torch.bfloat16 else 1e-5  # (bfloat16's norm is a bfloat16)
            assert got[k].item() == pytest.approx(_reference(t), rel=rel, abs=1e-30), k
        assert l2_norm_values(tensors) == got.tolist()  # the same values, read one by one
        assert "aten::dot" not in _ops(tensors)
    assert l2_norms([]).numel() == 0 and l2_norm_values([]) == []


def test_nan_and_inf_are_not_hidden(threads):
    big = torch.ones(DOT_MEAN_ELEMENTS * 2)
    with_nan, with_inf = big.clone(), big.clone()
    with_nan[123] = math.nan
    with_inf[5] = -math.inf
    for got in (l2_norms([with_nan, with_inf, big]).tolist(), l2_norm_values([with_nan, with_inf, big])):
        assert math.isnan(got[0])
        assert got[1] == math.inf
        assert got[2] == pytest.approx(math.sqrt(big.numel()))


def test_records_no_graph_and_leaves_the_tensors_alone(threads):
    w = torch.randn(400, 400, requires_grad=True)
    before = w.detach().clone()
    with torch.no_grad():
        got = l2_norms([w, w[:300]])
    assert not got.requires_grad
    assert torch.equal(w.detach(), before)
    assert w._version == 0
