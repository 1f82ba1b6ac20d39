"""Issue 37 (3): an explosion with nothing to compare it to.

A ReLU RNN whose recurrent weights have a spectral radius of 3 explodes through time inside one
module from step 0: a regression loss of 1e13 and gradient norms of 1e16, every layer alike, Adam
keeping it finite. The across-depth and the in-run rules compare layers, or the run with its own
start, and reported "No problem found". Judged now by the one layer that multiplies the signal by
itself: its output 1000x the largest scale before it in the forward. Its healthy twin (radius 1)
stays quiet."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.training import train
from tests.tracebuilder import TraceBuilder, findings
from torchautopsy import load
from torchautopsy.analyzer.run import analyze


class Summer(nn.Module):
    """A ReLU RNN over 40 steps and a linear head: learns the sum of its inputs' first feature."""

    def __init__(self, radius: float):
        super().__init__()
        self.rnn, self.head = nn.RNN(4, 32, nonlinearity="relu", batch_first=True), nn.Linear(32, 1)
        with torch.no_grad():
            q, _ = torch.linalg.qr(torch.randn(32, 32))
            self.rnn.weight_hh_l0.copy_(radius * q)  # an orthogonal matrix scaled: spectral radius `radius`

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 40, 4, generator=g)
    return x, x[:, :, 0].sum(1, keepdim=True)


def _exploding(tmp_path, radius: float) -> list:
    torch.manual_seed(0)
    model = Summer(radius)
    train(model, tmp_path / "run", 40, _batch, F.mse_loss, optimizer=torch.optim.Adam(model.parameters(), 1e-3))
    return [f for f in analyze(load(tmp_path / "run")) if f.kind == "exploding_gradients"]


def test_a_recurrent_layer_exploding_through_time_is_found_from_step_0(tmp_path):
    (f,) = _exploding(tmp_path, 3.0)
    assert (f.severity, f.step) == ("warning", 0)
    assert f.where == ["rnn"] and f.evidence["amplification"] >= 1e3
    assert _exploding(tmp_path / "twin", 1.0) == []


def test_the_amplification_rule_on_written_traces(tmp_path):
    def run(path, rnn_rms):
        b = TraceBuilder.mlp(layers=3, steps=30).loss(40.0).total_grad_norm(1.0)
        b.set("steps/input_mean", 0.0).set("steps/input_std", 1.0)
        # modules: "", "0" (Linear), "1" (ReLU), "2" (Linear), "3" (ReLU), "4" (Linear, the head)
        b.activations([0], mean={m: 0.0 for m in ("0", "1", "2", "3", "4")},
                      std={"0": 1.0, "1": 0.6, "2": rnn_rms, "3": rnn_rms, "4": 1.0})
        b.write(path)
        return findings(path, "exploding_gradients")

    (f,) = run(tmp_path / "hot", 5e3)  # module "2" makes 5,000x what came before it
    assert (f.step, f.where) == (0, ["2"]) and 4e3 < f.evidence["amplification"] < 6e3
    assert run(tmp_path / "ok", 20.0) == []
