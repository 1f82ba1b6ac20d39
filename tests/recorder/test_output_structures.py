"""Issue 36: a model's output of any structure is recorded, in eager mode and compiled: a tensor,
a tuple holding None (nanoGPT's ``(logits, None)``), a dict, a dataclass. Its NaN is found on
the step, at the module whose output went non-finite."""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder, load

BAD = 10  # a watched step: found by the hooks on the step itself


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    extras: dict | None = None


class Net(nn.Module):
    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape
        self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        logits = self.head(torch.relu(self.fc(x)))
        if self.shape == "tuple_none":
            return logits, None
        if self.shape == "dict":
            return {"logits": logits, "aux": None, "n": 3}
        if self.shape == "dataclass":
            return Out(logits, None, {"hidden": [None, logits.detach()]})
        return logits


def _logits(out):
    return out[0] if isinstance(out, tuple) else out["logits"] if isinstance(out, dict) else \
        out.logits if isinstance(out, Out) else out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("shape", ["tensor", "tuple_none", "dict", "dataclass"])
def test_every_output_structure_is_recorded_and_its_nan_found(shape, compiled):
    torch._dynamo.reset()
    run = Path(tempfile.mkdtemp(prefix="outputs_")) / "run"
    torch.manual_seed(0)
    model = Net(shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fwd = torch.compile(model, backend="aot_eager") if compiled else model
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, Recorder(fwd, run) as rec:
        warnings.simplefilter("always")
        for step in range(14):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            if step == BAD:
                with torch.no_grad():
                    model.head.bias[0] = float("nan")
            loss = F.cross_entropy(_logits(fwd(x)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    assert not [w for w in caught if "torchautopsy" in str(w.message)]
    rt = load(run).ranks[0]
    assert rt.closed_cleanly and rt.n_steps == 14
    outs = rt.module_stat()
    assert outs.loc[0, "(model)"] > 0  # the model's own output, measured eagerly even when compiled
    origin = rt.steps["nonfinite_origin"].to_numpy()
    # (compiled: the inner modules are not measured on the step; its replay on an eager copy names it)
    assert (origin[:BAD] == -1).all() and rt.module_names[origin[BAD]] == "head"
    assert np.isfinite(rt.steps["input_mean"].to_numpy()).all()  # the batch, every step
