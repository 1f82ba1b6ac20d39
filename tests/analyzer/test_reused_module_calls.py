"""A module the forward calls more than once has a site per call (recorder/forward/call_sites.py): its
outputs call by call, on a real library's weight-shared model (ALBERT runs one layer for every
depth), and the call that made a NaN/Inf named by the nonfinite finding."""

from __future__ import annotations

import glob

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from tests.training import squared, train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze


def test_albert_shared_layer_has_a_site_per_depth(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.AlbertModel(cfg)

    def loss_fn(out):
        return out.last_hidden_state.pow(2).mean()

    ids = torch.randint(0, 100, (4, 12))
    run = train(model, str(tmp_path), 6, lambda step: ids, loss_fn, activations_every=1)
    rt = load(run).ranks[0]
    sites = rt.call_sites
    shared = "encoder.albert_layer_groups.0.albert_layers.0"
    mine = sites[sites["module"] == shared]
    assert sorted(mine["call"]) == [0, 1, 2, 3], sites  # one site per depth it runs at
    absmax = rt.call_stat("output_absmax")
    cols = [f"{shared}#{c}" for c in range(4)]
    per_call = absmax[cols].to_numpy()
    assert (per_call > 0).all()
    # The module's own column is the largest of its calls'; the calls differ (what it hid).
    combined = rt.module_stat()[shared].loc[absmax.index].to_numpy()
    np.testing.assert_allclose(per_call.max(axis=1), combined, rtol=1e-6)
    assert np.ptp(per_call[0]) > 0
    # Per-call means combine into the module's activation mean (equal sizes: their average).
    mean = rt.call_stat("mean")[cols].to_numpy()
    np.testing.assert_allclose(mean.mean(axis=1), rt.activation_stat("mean")[shared].to_numpy(), rtol=1e-4, atol=1e-6)
    # A module called once has no site.
    assert "pooler.dense" not in set(sites["module"])


class _Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class _Shared(nn.Module):
    """One block applied three times, the k-th call's exponent scaled by k x `scale`: at scale 40
    the third call's exp overflows (e^120 > float32's max), the first two's do not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.exp = _Exp()
        self.out = nn.Linear(4, 1)
        self.scale = 1.0

    def forward(self, x):
        for k in range(3):
            x = self.exp(torch.tanh(self.lin(x)) * self.scale * (k + 1))
        return self.out(x)


def test_nonfinite_names_the_call_of_a_reused_module(tmp_path):
    torch.manual_seed(0)
    model = _Shared()

    def before(step):  # from step 8 the third call's exp overflows
        model.scale = 40.0 if step >= 8 else 1.0

    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4) * 3)
        model.lin.bias.fill_(3.0)
    x = torch.ones(2, 4)
    run = train(model, str(tmp_path), 10, lambda step: x, squared, before_step=before, activations_every=1,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    with h5py.File(glob.glob(f"{run}/rank0.h5")[0], "r") as f:  # lin and exp, three calls each, as they ran
        assert list(f["call_sites/call"][:]) == [0, 0, 1, 1, 2, 2]
    nf = [f for f in analyze(load(run)) if f.kind == "nonfinite"]
    assert len(nf) == 1 and nf[0].step == 8, nf
    f = nf[0]
    assert f.where == ["exp"]
    assert (f.evidence["origin_call"], f.evidence["origin_calls"]) == (2, 3), f.evidence
    assert "exp (_Exp), its third call of 3 in the step," in f.summary, f.summary
