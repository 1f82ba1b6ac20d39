"""Where NaN/Inf was born (issue 22): a -Inf is a fault or a mask by where it goes, not by who
made it. Real models trained a few steps with the real recorder, the findings of the real
analyzer: -Inf, +Inf and NaN born in weightless and weighted modules, in the forward and the
backward pass, on watched steps and on steps the recorder replays."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze

BAD = 7  # not a watched step with activations_every=10: found by the replay


class Log(nn.Module):  # weightless: log of its input (of a zero: -Inf)
    def forward(self, x):
        return torch.log(x)


class Abs(nn.Module):
    def forward(self, x):
        return x.abs()


class Scale(nn.Module):  # weighted, elementwise: a zero input stays exactly zero
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.weight


class Sqrt(nn.Module):  # weightless: sqrt (of a negative: NaN; at 0 its gradient is Inf)
    def forward(self, x):
        return torch.sqrt(x)


class MaskedAttention(nn.Module):
    """A causal mask built as -Inf by a weightless module, fed to a softmax: a mask, no fault."""

    class CausalMask(nn.Module):
        def forward(self, scores):
            n = scores.shape[-1]
            return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))

    def __init__(self):
        super().__init__()
        self.qk = nn.Linear(8, 8)
        self.mask = self.CausalMask()

    def forward(self, x):  # (batch, tokens, 8)
        q = self.qk(x)
        return torch.softmax(self.mask(q @ q.transpose(1, 2)), dim=-1) @ x


def _batch(step: int, zero_at: int | None = None, negative_at: int | None = None):
    g = torch.Generator().manual_seed(step)
    x = torch.rand(16, 8, generator=g) + 0.5
    if step == zero_at:
        x[3, 2] = 0.0  # abs -> 0, log -> -Inf
    if step == negative_at:
        x[3, 2] = -4.0
    return x, torch.randn(16, 1, generator=g)


def _train(model, steps=10, loss_fn=F.mse_loss, batch=_batch, **options) -> list:
    torch.manual_seed(0)
    run = train(model, tempfile.mkdtemp(prefix="naninf_"), steps, batch, loss_fn,
                optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), hold_output=True, **options)
    bad = [f for f in analyze(load(run)) if f.kind == "nonfinite"]
    assert len(bad) == 1, bad
    return bad[0]


@pytest.mark.parametrize("every", [1, 10], ids=["watched", "replayed"])
def test_a_log_of_zero_feeding_a_linear_is_born_in_the_log_not_the_linear(every):
    """The issue's case: a weightless log(0) = -Inf fed to a Linear, which makes NaN of it. The
    Linear's inputs were not finite: the log is named, the Linear as the module that took it in."""
    model = nn.Sequential(Scale(), Abs(), Log(), nn.Linear(8, 1))
    with torch.no_grad():
        model[3].weight[0, 2] = -0.5  # -Inf * -0.5: the Linear makes +Inf of it
    f = _train(model, batch=lambda s: _batch(s, zero_at=BAD), activations_every=every)
    assert f.step == BAD and f.where == ["2"] and f.evidence["stage"] == "forward", f
    assert f.evidence["chain"] == {"producer": "2", "consumer": "3", "step": BAD}
    assert "2 (Log) made -Inf from finite inputs" in f.summary and "3 (Linear)" in f.summary
    assert "inputs were finite" not in f.summary  # (the Linear's were not)
    assert "log" in f.advice


@pytest.mark.parametrize("every", [1, 10], ids=["watched", "replayed"])
def test_a_minus_inf_summed_into_the_loss_outside_the_modules_is_named(every):
    """log(0) in a weightless module whose -Inf no module consumes: the loss (a sum outside the
    modules) goes -Inf, and the log is the origin."""
    model = nn.Sequential(Scale(), Abs(), Log())
    f = _train(model, batch=lambda s: _batch(s, zero_at=BAD), loss_fn=lambda out, y: -out.mean(),
               activations_every=every)
    assert f.step == BAD and f.where == ["2"] and f.evidence["stage"] == "forward", f
    assert "chain" not in f.evidence


def test_a_mask_into_a_softmax_is_not_a_fault_and_a_later_nan_is_found():
    """-Inf masks into a softmax every step: no fault. A NaN born by sqrt of a negative at step
    BAD (weightless, after the attention) is named, not the mask."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MaskedAttention()
            self.sqrt = Sqrt()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.sqrt(self.attn(x.view(4, 4, 8)))).view(16, 1)

    f = _train(Net(), batch=lambda s: _batch(s, negative_at=BAD), activations_every=1)
    assert f.step == BAD and f.where == ["sqrt"] and f.evidence["stage"] == "forward", f


def test_an_inf_made_by_a_weighted_module_from_finite_inputs_is_born_there():
    """+Inf from a Linear whose weights overflow float32 at step BAD (set by the test before it)."""

    class Blow(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    model = Blow()

    def batch(step):
        if step == BAD:
            with torch.no_grad():
                model.fc1.weight.fill_(3e38)
        return _batch(step)

    f = _train(model, batch=batch, activations_every=1)
    assert f.step == BAD and f.where == ["fc1"] and f.evidence["stage"] == "forward", f


@pytest.mark.parametrize("every", [1, 10], ids=["watched", "replayed"])
def test_a_nan_made_by_a_weightless_module_is_born_there(every):
    model = nn.Sequential(Scale(), Sqrt(), nn.Linear(8, 1))
    f = _train(model, batch=lambda s: _batch(s, negative_at=BAD), activations_every=every)
    assert f.step == BAD and f.where == ["1"] and f.evidence["stage"] == "forward", f


def test_a_nan_born_in_the_backward_pass_is_not_blamed_on_a_forward_module():
    """sqrt at exactly 0: the forward is finite (0), its gradient Inf, then NaN downstream."""
    model = nn.Sequential(Scale(), Abs(), Sqrt(), nn.Linear(8, 1))
    f = _train(model, batch=lambda s: _batch(s, zero_at=BAD), activations_every=1)
    assert f.step == BAD and f.evidence["stage"] == "backward", f
    assert f.where == ["0.weight"]  # sqrt's Inf derivative at 0 times 0: NaN in the scale's gradient


def test_a_minus_inf_passed_through_ops_outside_the_modules_is_traced_to_its_maker():
    """The -Inf leaves its maker (log) and goes through an add outside the modules before a
    weightless gate multiplies it by 0 (NaN): the gate's input is another tensor than the log's
    output, and the log, the latest module to make a -Inf, is still named (GPT-2's -Inf
    embedding row turned into NaN by its dropout, from the corpus)."""

    class Gate(nn.Module):  # multiplies feature 2 by 0, as a dropout may
        def forward(self, x):
            keep = torch.ones(x.shape[-1])
            keep[2] = 0.0
            return x * keep

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.abs, self.log = Scale(), Abs(), Log()
            self.pos = nn.Linear(8, 8)
            self.gate = Gate()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.gate(self.log(self.abs(self.scale(x))) + self.pos(x)))

    f = _train(Net(), batch=lambda s: _batch(s, zero_at=BAD), activations_every=1)
    assert f.step == BAD and f.where == ["log"] and f.evidence["chain"]["consumer"] == "gate", f


@pytest.mark.parametrize("every", [1, 10], ids=["watched", "replayed"])
def test_a_nan_loss_with_zero_gradients_is_found_and_put_in_the_loss(every):
    """cross_entropy with every target ignored is 0/0 = NaN while every gradient is exactly 0
    (pytorch#70348): a NaN loss given to rec.step() is a NaN, not a missing loss."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def batch(step):
        x, _ = _batch(step)
        y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(step))
        return x, torch.full_like(y, -100) if step == BAD else y

    f = _train(model, batch=batch, loss_fn=F.cross_entropy, activations_every=every)
    assert f.step == BAD and f.where == [] and f.evidence["stage"] == "loss", f
    # Watched: every module checked. Not watched: the outputs the loop still held, on the step.
    assert ("every module output was finite" if every == 1 else "checked on the step itself") in f.summary
    assert "NllLossBackward0" in f.evidence["loss_ops"] and f.evidence["outputs_nonfinite_on_step"] is False
    assert "every target is ignore_index" in f.summary and "max(count, 1)" in f.advice


@pytest.mark.parametrize("every", [1, 10], ids=["watched", "replayed"])
def test_a_nan_born_in_the_loss_functions_backward_is_put_in_the_loss(every):
    """A hand-written distance loss, sqrt(sum((a - b)^2)), meets a pair of identical rows at
    step BAD: the forward and the loss are finite (0), sqrt's derivative at 0 is Inf, and the
    gradient reaching the model's outputs is NaN. No module is to blame: the loss's backward is."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def batch(step):
        x, _ = _batch(step)
        if step == BAD:
            x[8:] = x[:8]  # the second half of the batch pairs each row with itself
        return x, None

    def distance(out, _):
        a, b = out[:8], out[8:]
        return torch.sqrt(((a - b) ** 2).sum(dim=1)).mean()

    f = _train(model, batch=batch, loss_fn=distance, activations_every=every)
    assert f.step == BAD and f.evidence["stage"] == "loss_backward" and f.where == [], f
    assert "born in the loss function's backward" in f.summary and "sqrt" in f.advice
    # Named from the loss's graph: sqrt, whose derivative is infinite at 0; not the square
    # (x ** 2: a bounded derivative), though it is in the loss too.
    assert "the loss function uses sqrt," in f.summary and "pow" not in f.summary, f.summary
    assert {"SqrtBackward0", "PowBackward0:2"} <= set(f.evidence["loss_ops"])
    assert "add eps inside it" in f.advice


@pytest.mark.parametrize("every", [1, 10], ids=["watched", "replayed"])
def test_a_log_of_a_softmax_underflowing_in_the_loss_is_named(every):
    """The issue's case: a hand-written -log(softmax(logits)) whose softmax underflows to exactly
    0 on a batch with logits far apart (an input 1e4 times too large): the model's outputs are
    finite, the loss is Inf. The finding says the loss function made it, names the log of a
    softmax, and advises log_softmax; no module is blamed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def batch(step):
        x, _ = _batch(step)
        y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(step))
        return (x * 1e4 if step == BAD else x), y

    def nll_of_softmax(out, y):
        return -torch.log(torch.softmax(out, dim=-1)[torch.arange(len(y)), y]).mean()

    f = _train(model, batch=batch, loss_fn=nll_of_softmax, activations_every=every)
    assert f.step == BAD and f.where == [] and f.evidence["stage"] == "loss", f
    assert "the loss function uses log" in f.summary and "the log of a softmax" in f.summary, f.summary
    assert f.advice.startswith("Replace log(softmax(x)) with F.log_softmax(x)"), f.advice
    assert f.evidence["loss_ops"][:3] == ["NegBackward0", "MeanBackward0", "LogBackward0"]
