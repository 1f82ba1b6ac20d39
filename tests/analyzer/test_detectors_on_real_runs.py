"""Detectors on traces of real training runs made in the test: the edge cases users hit."""

import json

import numpy as np
import torch
from torch import nn

from tests import training
import torchautopsy
from torchautopsy import load
from torchautopsy.analyzer.run import analyze


def mlp(depth=3, width=32, act=nn.ReLU):
    layers, d = [], 8
    for _ in range(depth):
        layers += [nn.Linear(d, width), act()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, 1))


def train(run_dir, model, steps=60, lr=0.05, step_before_zero_grad=True, loss_scale=None):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)

    def batch(step):
        x = torch.randn(32, 8, generator=g)
        return x, x, step

    def loss_fn(out, x, step):
        loss = (out - x.sum(1, keepdim=True)).pow(2).mean()
        return loss * loss_scale(step) if loss_scale else loss

    def zero_grad_too_early(step, loss):
        opt.zero_grad(set_to_none=True)  # the mistake: gradients gone before rec.step()

    training.train(model, run_dir, steps, batch, loss_fn, optimizer=opt,
                   after_update=None if step_before_zero_grad else zero_grad_too_early)
    return load(run_dir)


def kinds(findings, severities=("error", "warning")):
    return [f.kind for f in findings if f.severity in severities]


def test_healthy_run_is_quiet(tmp_path):
    torch.manual_seed(0)
    findings = analyze(train(tmp_path, mlp(), lr=0.01))
    assert kinds(findings) == [], [f.summary for f in findings]


def test_gradients_cleared_before_rec_step_are_those_the_optimizer_step_used(tmp_path):
    """`opt.step(); opt.zero_grad(); rec.step()`: the norms come from the optimizer step's hook."""
    torch.manual_seed(0)
    early = train(tmp_path / "early", mlp(), step_before_zero_grad=False)
    torch.manual_seed(0)
    right = train(tmp_path / "right", mlp())
    np.testing.assert_array_equal(early.ranks[0].param_stat("grad_norm").to_numpy(),
                                  right.ranks[0].param_stat("grad_norm").to_numpy())
    assert kinds(analyze(early)) == []


def test_gradients_read_after_they_were_cleared_say_so_instead_of_crashing(tmp_path):
    """A hand-written update (no optimizer step for a hook to see) whose loop clears the gradients
    before rec.step(): no gradient is recorded, and the detectors say why."""
    torch.manual_seed(0)
    model = mlp()
    g = torch.Generator().manual_seed(1)
    with torchautopsy.Recorder(model, tmp_path / "run") as rec:
        for _ in range(60):
            x = torch.randn(32, 8, generator=g)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            model.zero_grad()  # the mistake: gradients gone before rec.step()
            rec.step(loss=loss)
    findings = analyze(load(tmp_path / "run"))
    # (on a loaded machine a slow_steps info may come too: steps here take a millisecond)
    info = [f for f in findings if f.kind in ("exploding_gradients", "vanishing_gradients")]
    assert {f.kind for f in info} == {"exploding_gradients", "vanishing_gradients"}
    assert all(f.severity == "info" and "before the next optimizer.zero_grad()" in f.advice for f in info)
    assert kinds(findings) == []


def test_one_bad_batch_is_a_spike_warning_not_an_error(tmp_path):
    # One batch with a loss 1e4 times too large (think: a corrupt label) at step 40, then normal.
    torch.manual_seed(0)
    findings = analyze(train(tmp_path, mlp(), lr=1e-5, loss_scale=lambda s: 1e4 if s == 40 else 1.0))
    (f,) = [f for f in findings if f.kind == "exploding_gradients"]
    assert f.severity == "warning" and f.step == 40, f.summary
    json.dumps(f.to_dict(), allow_nan=False)


def test_zero_gradients_everywhere_is_flagged(tmp_path):
    # The output passes through a ReLU whose pre-activations are all negative: nothing learns.
    torch.manual_seed(0)
    model = mlp()
    model.append(nn.ReLU())
    with torch.no_grad():
        model[-2].bias.fill_(-100.0)
    findings = analyze(train(tmp_path, model))
    (f,) = [f for f in findings if f.kind == "vanishing_gradients"]
    assert f.severity == "warning" and "zero" in f.summary
