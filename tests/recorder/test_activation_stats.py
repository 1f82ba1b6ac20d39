"""activation_stats: the per-call sums a watched step takes of each module output (combined per
module on the host by combine_stats), checked against float64 statistics of the same part."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from torchautopsy.recorder.reductions.stats import STATS_MAX_ELEMENTS, activation_stats, combine_stats, stats_part


def _output(dtype: torch.dtype) -> torch.Tensor:
    """A ReLU-like output: about half exact zeros, both signed zeros, a subnormal, mean >> std
    in one column (the shifted sums must not cancel)."""
    g = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(64, 48, generator=g)).to(dtype)
    x[0, 0], x[0, 1] = -0.0, 0.0
    x[:, 2] = 1000.0 + torch.randn(64, generator=g).to(dtype)
    if dtype != torch.bfloat16:
        x[1, 3] = torch.finfo(dtype).tiny / 4  # subnormal: not zero
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sums_and_zero_count_match_float64(dtype):
    x = _output(dtype)
    row, n = activation_stats(x)
    assert n == x.numel() and row.dtype == torch.float32
    p = stats_part(x).double()
    mean, std, zero = combine_stats(1, {0: [0]}, np.array([n]), row.numpy().reshape(1, 4))
    assert zero[0] == (p == 0).double().mean().item()  # exact: a count
    np.testing.assert_allclose(mean[0], p.mean().item(), rtol=1e-5 if dtype != torch.bfloat16 else 1e-2)
    np.testing.assert_allclose(std[0], p.std().item(), rtol=1e-4 if dtype != torch.bfloat16 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_nan_makes_mean_std_and_zero_share_nan(dtype):
    x = _output(dtype)
    x[5, 5] = math.nan
    row, n = activation_stats(x)
    stats = combine_stats(2, {1: [0]}, np.array([n]), row.numpy().reshape(1, 4))
    for values in stats:
        assert np.isnan(values).all()  # module 0: not called; module 1: held a NaN


def test_a_large_output_is_cut_to_its_first_rows():
    big = torch.zeros(STATS_MAX_ELEMENTS // 16, 64)
    big[STATS_MAX_ELEMENTS // 64:] = 1.0  # past the part: not seen
    row, n = activation_stats(big)
    assert n == STATS_MAX_ELEMENTS and row[2].item() == 0  # no nonzero element in the part


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_in_another_dtype_is_recorded_with_its_activation_statistics(tmp_path, dtype):
    """float64 once stopped the recorder at its first watched step (a float32 norm asked of
    float64 values raised inside the forward hook): a whole recording, checked against the
    outputs themselves."""
    from torchautopsy import Recorder
    from recorder_testlib import names, open_trace

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dtype)
    relu_out = []
    model[1].register_forward_hook(lambda m, a, o: relu_out.append(o.detach().double()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recorder error warns: fail on it
        with Recorder(model, tmp_path / "run") as rec:
            for _ in range(3):
                opt.zero_grad()
                loss = model(torch.randn(64, 16, dtype=dtype)).float().pow(2).mean()
                loss.backward()
                opt.step()
                rec.step(loss=loss)
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert f.attrs["n_steps_recorded"] == 3 and f["steps/step"].shape[0] == 3
        i = names(f["modules/name"]).index("1")
        assert f["activations/step"][0] == 0
        assert f["activations/zero_frac"][0, i] == pytest.approx((relu_out[0] == 0).double().mean().item(), abs=1e-6)
        np.testing.assert_allclose(f["activations/mean"][0, i], relu_out[0].mean().item(),
                                   rtol=1e-5 if dtype == torch.float64 else 1e-2)
        assert np.isfinite(f["params/grad_norm"][:]).all()
