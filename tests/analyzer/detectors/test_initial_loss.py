"""initial_loss (issue 27): a classifier whose loss starts far above ln(classes) -- a last layer
initialised 30x too large, targets that are multi-hot instead of a distribution -- and a run whose
loss never moves (a learning rate of 0); the usual initialisation of a torch model and of a
transformers BERT (which computes its own loss) start near ln(classes) and stay quiet."""

from __future__ import annotations

import math

import numpy as np
import pytest

import torch
import torch.nn.functional as F
from torch import nn

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze

CLASSES = 10


def mlp(gain: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    with torch.no_grad():
        model[2].weight.mul_(gain)
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 20, generator=g)
    return x, x[:, :CLASSES].argmax(1)


def found(tmp_path, model, loss_fn=F.cross_entropy, steps=30, lr=1e-2):
    train(model, tmp_path / "run", steps, batch, loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    return {f.evidence["cause"]: f for f in analyze(load(tmp_path / "run")) if f.kind == "initial_loss"}


def test_a_last_layer_initialised_too_large_starts_far_above_ln_classes(tmp_path):
    f = found(tmp_path, mlp(gain=30.0))["far_from_chance"]
    assert (f.severity, f.step, f.evidence["classes"]) == ("warning", 0, CLASSES)
    assert f.evidence["chance_loss"] == math.log(CLASSES) and f.evidence["initial_loss"] > 2 * math.log(CLASSES)
    assert "NllLossBackward0" in f.evidence["loss_ops"]


def test_multi_hot_targets_start_far_above_ln_classes(tmp_path):
    """Soft targets that are multi-hot (3 classes at 1.0) instead of a distribution: ~3 ln(C)."""
    def multi_hot(out, y):
        t = torch.zeros_like(out)
        t[torch.arange(len(y)), y] = 1.0
        t[torch.arange(len(y)), (y + 1) % CLASSES] = 1.0
        t[torch.arange(len(y)), (y + 2) % CLASSES] = 1.0
        return torch.sum(-t * F.log_softmax(out, dim=1), dim=1).mean()
    assert "far_from_chance" in found(tmp_path, mlp(), multi_hot)


def test_the_default_initialisation_starts_near_chance_and_is_quiet(tmp_path):
    assert found(tmp_path, mlp()) == {}


def test_a_loss_that_never_moves(tmp_path):
    f = found(tmp_path, mlp(), steps=120, lr=0.0)["never_moved"]
    assert f.severity == "warning" and abs(f.evidence["relative_change"]) <= f.evidence["tolerance"] < 0.05
    assert "never_moved" not in found(tmp_path / "sgd", mlp(), steps=120)  # (lr 0.01: it learns)


@pytest.mark.slow  # transformers
def test_bert_computing_its_own_loss_starts_near_chance(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200, num_labels=5))
    ids = torch.randint(0, 200, (8, 12))
    labels = torch.arange(8) % 5
    from torchautopsy import Recorder
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with Recorder(model, tmp_path / "run") as rec:
        for step in range(6):
            loss = model(input_ids=ids.roll(step, 1), labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    rt = load(tmp_path / "run").ranks[0]
    assert rt.loss_function_ops == []  # (the model's own)
    from torchautopsy.analyzer.detectors.initial_loss import _chance
    assert _chance(rt)[:2] == (5, math.log(5))
    assert [f for f in analyze(load(tmp_path / "run")) if f.kind == "initial_loss"] == []
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 5.0)  # the same model, its head initialised 250x too large: found
    with Recorder(model, tmp_path / "big") as rec:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        rec.step(loss=loss)
    (f,) = [f for f in analyze(load(tmp_path / "big")) if f.kind == "initial_loss"]
    assert f.evidence["classes"] == 5


def _loss_trace(tmp_path, values):
    from tests.tracebuilder import TraceBuilder, findings

    TraceBuilder.mlp(steps=len(values)).loss(values).set("steps/optimizer_steps", 1).write(tmp_path)
    return [f for f in findings(tmp_path, "initial_loss") if f.evidence.get("cause") == "never_moved"]


def test_a_loss_that_fell_in_its_first_steps_and_slowly_after_moved(tmp_path):
    """Judged from where the loss started (issue 37): an IRNN on the adding problem falls 1.19 ->
    0.2 in 10 steps and 0.2 -> 0.17 over the next 290; a loss that fell 40% and then plateaued."""
    rng = np.random.default_rng(0)
    n = 300
    fast = np.concatenate([np.geomspace(1.19, 0.2, 10), np.linspace(0.2, 0.17, n - 10)]) * (1 + rng.normal(0, 0.3, n))
    assert _loss_trace(tmp_path / "fast", fast) == []
    plateau = np.concatenate([np.linspace(2.0, 1.2, 10), np.full(n - 10, 1.2)]) * (1 + rng.normal(0, 0.03, n))
    assert _loss_trace(tmp_path / "plateau", plateau) == []
    (f,) = _loss_trace(tmp_path / "still", 2.3 * (1 + rng.normal(0, 0.03, n)))
    assert f.step == 0 and abs(f.evidence["relative_change"]) <= f.evidence["tolerance"]
