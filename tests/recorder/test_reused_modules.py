"""Issue 37 (1): one module called several times in a step is a site per call.

torchvision's BasicBlock calls its one ``nn.ReLU`` twice: after bn1 and after the residual sum.
When bn1 pushes every channel below zero, the first call is 100% dead while the second lives;
the recorder once OR'ed the two calls into one site, and no dead_relu was found. Here each call
is judged alone and the finding says which call."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder, load
from tests.helpers import invoke_cli


class BasicBlock(nn.Module):
    """The shape of torchvision's ResNet BasicBlock: conv-bn-relu-conv-bn, + identity, relu (the same module)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.layer(self.stem(x)).mean(dim=(2, 3)))


def test_the_dead_first_call_of_a_relu_called_twice_is_found_and_named():
    torch.manual_seed(0)
    model = TwoBlocks()
    with torch.no_grad():
        model.layer[0].bn1.bias.fill_(-10.0)  # every channel of bn1's output below zero: the first relu dead
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = Path(tempfile.mkdtemp(prefix="reused_")) / "run"
    g = torch.Generator().manual_seed(1)
    with Recorder(model, run) as rec:
        for step in range(60):
            x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    sites = load(run).ranks[0].activity_sites
    relu = sites[sites["module"] == "layer.0.relu"]
    assert sorted(relu["call"]) == [0, 1]  # a site per call
    out = run.parent / "f.json"
    assert invoke_cli("analyze", run, "--json", out, block_torch=True).returncode == 0
    dead = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "dead_relu"]
    assert [(f["where"], f["evidence"]["call"], f["evidence"]["calls"]) for f in dead] == [(["layer.0.relu"], 0, 2)]
    (f,) = dead
    assert f["step"] == 0 and f["evidence"]["dead_share"] == 1.0
    assert "layer.0.relu, its first call of 2 in a step" in f["summary"]
    assert "BasicBlock.forward" in f["evidence"]["code"]["layer.0.relu"]
