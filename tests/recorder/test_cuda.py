"""The recorder on a GPU: CUDA memory counters, CUDA profiler activity, NaN origin on device.

Skipped without CUDA (this project's CI has no GPU); run on a machine with one to check the
CUDA paths. The rest of the suite covers the same code on the CPU.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

from torchautopsy import Recorder, load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class NaNAt(nn.Module):
    def __init__(self, step):
        super().__init__()
        self.step, self.calls = step, 0

    def forward(self, x):
        self.calls += 1
        return x * math.nan if self.calls == self.step + 1 else x


def test_recorder_on_cuda(tmp_path):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), NaNAt(25), nn.Linear(256, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(model, tmp_path, profile_first=5) as rec:
        for _ in range(30):
            loss = model(torch.randn(128, 64, device=dev)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    rt = load(tmp_path).ranks[0]
    steps = rt.steps
    assert rt.meta["device"].startswith("cuda")
    assert (steps["cuda_allocated_bytes"] > 0).all() and (steps["cuda_reserved_bytes"] > 0).all()
    assert (steps["cuda_peak_bytes"] >= steps["cuda_allocated_bytes"]).all()
    origin = steps["nonfinite_origin"].to_numpy()
    assert (origin[:25] == -1).all() and rt.module_names[origin[25]] == "2"
    ops = rt.profile_ops(0)
    assert (ops["device_self_us"] > 0).any()  # CUDA kernels were profiled
    g = rt.param_stat("grad_norm").to_numpy()
    assert np.isfinite(g[:25]).all()


def test_copies_back_and_forth_are_flagged_on_cuda(tmp_path):
    # The loop copies its activations to the host and back every step (a debugging leftover).
    from torchautopsy.analyzer.run import analyze

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x_host = torch.randn(4096, 512)
    with Recorder(model, tmp_path, profile_first=5) as rec:
        for _ in range(12):
            x = x_host.to(dev)  # pageable memory, every step
            out = model(x)
            out.detach().cpu()
            x.cpu()
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    found = [f for f in analyze(load(tmp_path)) if f.kind == "host_device_copies"]
    assert found and found[0].evidence["share"] >= 0.2, [f.summary for f in found]
