"""l2_norms: the recorder's gradient and weight norms (a BLAS dot per large CPU tensor, one
_foreach_norm for the rest), checked against float64 norms, in the tensors' order."""

from __future__ import annotations

import math

import pytest
import torch

from torchautopsy.recorder.stats import DOT_MIN_ELEMENTS, l2_norms


def _reference(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.detach().double()).item()


def test_mixed_tensors_keep_their_order_and_match_float64():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(512, 512, generator=g),  # a dot
        torch.randn(512, generator=g),  # small: _foreach_norm
        torch.randn(300, 200, generator=g).t(),  # large but not contiguous: _foreach_norm
        torch.randn(DOT_MIN_ELEMENTS, generator=g, dtype=torch.float64) * 1e3,  # a float64 dot
        torch.randn(40_000, generator=g).bfloat16(),  # another dtype: _foreach_norm
        torch.zeros(0),  # empty
        torch.randn(64, 64, 8, generator=g) * 1e-20,  # tiny values, a dot
    ]
    got = l2_norms(tensors)
    assert got.shape == (len(tensors),)
    for k, t in enumerate(tensors):
        rel = 1e-2 if t.dtype == torch.bfloat16 else 1e-5  # (bfloat16's norm is a bfloat16)
        assert got[k].item() == pytest.approx(_reference(t), rel=rel, abs=1e-30), k


def test_every_tensor_large_or_every_tensor_small():
    g = torch.Generator().manual_seed(1)
    large = [torch.randn(256, 256, generator=g) * s for s in (1.0, 5.0, 0.01)]
    small = [torch.randn(7, generator=g), torch.randn(3, 3, generator=g)]
    for tensors in (large, small):
        got = l2_norms(tensors).tolist()
        assert got == pytest.approx([_reference(t) for t in tensors], rel=1e-5)
    assert l2_norms([]).numel() == 0


def test_nan_and_inf_are_not_hidden():
    big = torch.ones(DOT_MIN_ELEMENTS * 2)
    with_nan, with_inf = big.clone(), big.clone()
    with_nan[123] = math.nan
    with_inf[5] = -math.inf
    got = l2_norms([with_nan, with_inf, big]).tolist()
    assert math.isnan(got[0])
    assert got[1] == math.inf
    assert got[2] == pytest.approx(math.sqrt(big.numel()))


def test_records_no_graph_and_leaves_the_tensors_alone():
    w = torch.randn(200, 200, requires_grad=True)
    before = w.detach().clone()
    with torch.no_grad():
        got = l2_norms([w, w[:3, :3]])
    assert not got.requires_grad
    assert torch.equal(w.detach(), before)
    assert w._version == 0
