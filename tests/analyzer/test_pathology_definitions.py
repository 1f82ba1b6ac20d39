"""Issue 22's definitions on real training runs: exploding gradients present from the first step
(across depth, backward and forward), a loss stuck at exactly 0, and a NaN that enters the
backward pass at the model's outputs on a step whose outputs were not watched."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze


def _record(run_dir, model, batch, loss_fn, steps, lr, opt="sgd"):
    torch.manual_seed(0)
    o = (torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd"
         else torch.optim.Adam(model.parameters(), lr=lr))
    losses = []
    train(model, run_dir, steps, lambda step: (*batch(step), step), loss_fn, optimizer=o,
          after_step=lambda step, loss: losses.append(float(loss.detach())))
    return analyze(load(run_dir)), losses


def _by_kind(findings, kind):
    return [f for f in findings if f.kind == kind and f.severity in ("warning", "error")]


def _mlp(depth, width, act, std=None, n_in=16):
    torch.manual_seed(0)
    layers, d = [], n_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), act()]
        d = width
    model = nn.Sequential(*layers, nn.Linear(d, 1))
    if std is not None:
        for m in model:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std(m.in_features))
                nn.init.zeros_(m.bias)
    return model


def _regression():
    g = torch.Generator().manual_seed(1)

    def batch(step):
        x = torch.randn(32, 16, generator=g)
        return x, torch.tanh(x[:, :1])

    return batch


def _mse(out, y, step):
    return F.mse_loss(out, y)


def test_gradients_growing_towards_the_input_from_step_0_are_exploding(tmp_path):
    """A 16-layer tanh MLP in the chaotic regime (sigma_w = 4, Poole et al. 2016): the first
    layers' gradients are orders of magnitude above the last ones' from the first step."""
    model = _mlp(16, 64, nn.Tanh, std=lambda fan_in: 4.0 / math.sqrt(fan_in))
    findings, _ = _record(tmp_path / "chaotic", model, _regression(), _mse, 30, lr=1e-3)
    [f] = _by_kind(findings, "exploding_gradients")
    assert f.step == 0 and f.where[0] == "0.weight", f.summary
    assert f.evidence["early_to_late_rms_ratio"] >= 100 and "towards the input" in f.summary


def test_activations_growing_through_depth_from_step_0_are_exploding(tmp_path):
    """Weights drawn N(0, 0.35^2) in a ReLU stack (3x He's std): the outputs grow ~2-3x per layer
    and every gradient with them, while the ratio between layers stays ~1. Adam keeps it finite."""
    model = _mlp(8, 64, nn.ReLU, std=lambda fan_in: 3.0 * math.sqrt(2.0 / fan_in))
    findings, losses = _record(tmp_path / "gain", model, _regression(), _mse, 30, lr=1e-3, opt="adam")
    assert all(map(math.isfinite, losses))
    [f] = _by_kind(findings, "exploding_gradients")
    assert f.step == 0 and f.where[0] == "0" and f.evidence["activation_growth"] >= 100, f.summary
    assert "Activations explode through depth" in f.summary


def test_a_deep_he_initialised_relu_net_is_not_exploding(tmp_path):
    """The same depth with He's init (gain ~1 per layer), and a tanh net at the edge of chaos."""
    he = _mlp(8, 64, nn.ReLU, std=lambda fan_in: math.sqrt(2.0 / fan_in))
    findings, _ = _record(tmp_path / "he", he, _regression(), _mse, 30, lr=1e-3, opt="adam")
    assert _by_kind(findings, "exploding_gradients") == [], [f.summary for f in findings]
    edge = _mlp(16, 64, nn.Tanh, std=lambda fan_in: 1.0 / math.sqrt(fan_in))
    findings, _ = _record(tmp_path / "edge", edge, _regression(), _mse, 30, lr=1e-3)
    assert _by_kind(findings, "exploding_gradients") == [], [f.summary for f in findings]


def _sequences():
    g = torch.Generator().manual_seed(2)

    def batch(step):
        x = torch.randn(8, 12, 4, generator=g)
        return x, (x.sum(-1) > 0).float()

    return batch


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(4, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0]).squeeze(-1)


def test_a_loss_masked_to_nothing_is_exactly_0_and_reported(tmp_path):
    """A padding mask built with the wrong comparison keeps no token: the loss is exactly 0 on
    every step (the model learns nothing), a silent bug no other finding shows."""
    def masked(out, y, step):
        lengths = torch.full((out.shape[0],), out.shape[1])
        mask = (torch.arange(out.shape[1])[None, :] >= lengths[:, None]).float()  # the bug: >= instead of <
        per_token = F.binary_cross_entropy_with_logits(out, y, reduction="none")
        return (per_token * mask).sum() / mask.sum().clamp(min=1)

    findings, losses = _record(tmp_path / "masked", _Tagger(), _sequences(), masked, 40, lr=0.1)
    assert set(losses) == {0.0}
    [f] = [f for f in findings if f.kind == "loss_zero"]
    assert f.severity == "warning" and f.step == 0 and f.evidence["zero_loss_steps"] == 40, f.summary
    assert "log_softmax" in f.advice and "mask" in f.advice


def test_a_run_whose_loss_is_never_0_gets_no_loss_zero_finding(tmp_path):
    def right(out, y, step):
        return F.binary_cross_entropy_with_logits(out, y)

    findings, _ = _record(tmp_path / "right", _Tagger(), _sequences(), right, 40, lr=0.1)
    assert [f for f in findings if f.kind == "loss_zero"] == []


def test_a_nan_born_in_a_hand_written_loss_on_an_unwatched_step_is_the_loss_s(tmp_path):
    """-log(softmax(x)) written by hand on an over-confident classifier: the softmax of the
    target underflows to a denormal on step 1 (not a watched step), its log's backward (1/p)
    overflows, and every gradient goes NaN. The NaN entered at the model's outputs: no
    parameter is to blame (issue 22 saw the output layer's bias named)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(30)
    g = torch.Generator().manual_seed(1)
    centres = torch.randn(4, 8, generator=g) * 4
    with torch.no_grad():
        pred = model(centres).argmax(1)

    def batch(step):
        k = torch.randint(0, 4, (16,), generator=g)
        return centres[k] + 0.1 * torch.randn(16, 8, generator=g), pred[k]

    def hand_written(out, y, step):
        return -torch.log(torch.softmax(out, -1)).gather(1, y[:, None]).mean()

    findings, losses = _record(tmp_path / "neglog", model, batch, hand_written, 20, lr=0.1)
    bad = [f for f in findings if f.kind == "nonfinite"]
    assert len(bad) == 1 and bad[0].step == 1 and math.isfinite(losses[1]), (losses[:3], bad)
    f = bad[0]
    assert f.evidence["stage"] == "loss_backward" and f.where == [], f.summary
    assert "loss function's backward" in f.summary and "log of 0" in f.advice


_LEAK_JOB = """
import sys
from collections import OrderedDict
import torch
import torch.nn.functional as F
from torch import nn
from torchautopsy import Recorder

torch.manual_seed(0)
model = nn.Sequential(OrderedDict(fc1=nn.Linear(32, 32), relu1=nn.ReLU(), fc2=nn.Linear(32, 64),
                                  relu2=nn.ReLU(), out=nn.Linear(64, 1)))
kept = []
model.relu1.register_forward_hook(lambda m, a, out: kept.append(out))  # the bug: no detach, never cleared
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(3)
with Recorder(model, sys.argv[1]) as rec:
    for step in range(300):
        x = torch.randn(4096, 32, generator=g)
        loss = F.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(loss=loss)
"""


def test_a_leak_names_the_module_whose_outputs_are_kept_by_the_op_that_made_them(jobs, tmp_path):
    """A forward hook keeps relu1's outputs with their graph. fc1 outputs the same shape and
    dtype; the census's groups carry the op that made the kept tensors (ReluBackward0), and the
    recorder's module outputs theirs, so the finding names relu1 alone. (A job of its own: in
    the test process, memory freed by earlier tests hides the growth and a census costs more;
    forked from an interpreter that imported torch and ran nothing: tests/forked_jobs.py.)"""
    import sys

    r = jobs.run([sys.executable, "-c", _LEAK_JOB, str(tmp_path / "leak")], capture_output=True, text=True,
                 timeout=300)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    leaks = _by_kind(analyze(load(tmp_path / "leak")), "memory_leak")
    assert len(leaks) == 1, leaks
    f = leaks[0]
    assert f.where == ["relu1"], f.summary
    assert "made by ReluBackward0" in f.summary and f.evidence["growing_group"]["grad_fn"] == "ReluBackward0"


def _classifier_with_lr_jump(run_dir, jump: float):
    """A 3-layer MLP classifier with a hand-written -log(softmax) loss, SGD 0.05; at step 100
    the learning rate is multiplied by `jump` (a scheduler bug)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 4, generator=g)
    losses = []

    def lr_jump(step):
        if step == 100:
            for group in opt.param_groups:
                group["lr"] *= jump

    def batch(step):
        x = torch.randn(64, 8, generator=g)
        return x, (x @ w).argmax(1)

    def hand_written(out, y):
        return -torch.log(torch.softmax(out, -1)).gather(1, y[:, None]).mean()

    train(model, run_dir, 130, batch, hand_written, optimizer=opt, before_step=lr_jump,
          after_step=lambda step, loss: losses.append(float(loss.detach())))
    return analyze(load(run_dir)), losses


def test_logits_that_run_away_before_the_loss_goes_inf_are_reported_with_where_it_was_born(tmp_path):
    """lr x300: the last layer's outputs grow 30x in the step after the jump (the recorder
    watches it: a jump), then the hand-written log(softmax) gives log(0) = -inf on a step that
    was not watched. Its replay finds every module output finite, which does not prove the loss
    made it (a replay can differ from the step: test_recorder_nonfinite's PythonCountedNaN), so
    the NaN is not blamed on a module."""
    findings, losses = _classifier_with_lr_jump(tmp_path / "jump", 300.0)
    bad = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    [run] = [f for f in findings if f.kind == "runaway_outputs"]
    assert run.severity == "warning" and run.where == ["4"] and run.step == 100 + 1 and bad == 102, run.summary
    assert run.evidence["growth"] >= 10 and run.evidence["first_nonfinite_step"] == bad
    [nan] = [f for f in findings if f.kind == "nonfinite"]
    assert nan.step == bad and nan.evidence["stage"] == "unchecked" and nan.where == [], nan.summary


def test_logits_growing_in_a_run_that_never_fails_are_not_runaway(tmp_path):
    """lr x10: the logits grow ~10x over the next 40 steps as the classifier grows confident,
    and nothing fails: no finding."""
    findings, losses = _classifier_with_lr_jump(tmp_path / "ok", 10.0)
    assert all(map(math.isfinite, losses))
    assert [f for f in findings if f.kind == "runaway_outputs"] == []
