"""train_eval_mode (issue 27): the validation loop that calls model.eval() and never model.train()
again, and the evaluation run in train mode, planted in real models (a CNN with BatchNorm and
Dropout, transformers' BERT) as people write them; the loop that switches both ways stays quiet,
and so does a model without Dropout or BatchNorm, whose mode changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder, load
from torchautopsy.analyzer.run import analyze

STEPS, EVAL_AFTER = 24, 8  # a validation after step 7's optimizer step


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 4))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def run(tmp_path, model, evaluate, forward=None):
    """Train; after step EVAL_AFTER - 1, evaluate(model) runs a validation of 3 batches."""
    forward = forward or (lambda m, x, y: F.cross_entropy(m(x), y))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(model, tmp_path / "run", activations_every=5) as rec:
        for step in range(STEPS):
            loss = forward(model, *batch(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
            if step == EVAL_AFTER - 1:
                evaluate(model)
    return [f for f in analyze(load(tmp_path / "run")) if f.kind == "train_eval_mode"]


def validation(model, forward=None, eval_mode=True, back_to_train=True):
    forward = forward or (lambda m, x, y: F.cross_entropy(m(x), y))
    if eval_mode:
        model.eval()
    with torch.no_grad():
        for k in range(3):
            forward(model, *batch(1000 + k))
    if eval_mode and back_to_train:
        model.train()


def test_a_validation_that_never_calls_model_train_again_is_found_where_training_resumed(tmp_path):
    (f,) = run(tmp_path, cnn(), lambda m: validation(m, back_to_train=False))
    assert (f.severity, f.evidence["cause"], f.step) == ("warning", "trained_in_eval", EVAL_AFTER)
    assert f.evidence["train_steps_before"] == EVAL_AFTER and f.evidence["eval_steps"] == STEPS - EVAL_AFTER
    assert f.where == ["1", "5"] and "model.train()" in f.advice  # the BatchNorm2d and the Dropout


def test_an_evaluation_under_no_grad_without_model_eval_is_found(tmp_path):
    (f,) = run(tmp_path, cnn(), lambda m: validation(m, eval_mode=False))
    # (run after step 7's rec.step(): counted in the row of step 8, whose iteration it ran in)
    assert (f.severity, f.evidence["cause"], f.step) == ("warning", "evaluated_in_train", EVAL_AFTER)
    assert f.evidence["nograd_train_forwards"] == 3


def test_a_validation_that_switches_both_ways_is_quiet(tmp_path):
    assert run(tmp_path, cnn(), validation) == []


def test_a_model_without_dropout_or_batchnorm_is_not_judged(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Linear(32, 4))
    assert run(tmp_path, model, lambda m: validation(m, back_to_train=False)) == []
    assert (load(tmp_path / "run").ranks[0].columns["train_mode"].to_numpy()[EVAL_AFTER:] == 0).all()


@pytest.mark.slow  # transformers
def test_bert_left_in_eval_mode_after_its_validation(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200, num_labels=4))
    ids = torch.randint(0, 200, (8, 12))

    def forward(m, x, y):
        return m(input_ids=ids.roll(int(y[0]), 1), labels=y).loss

    (f,) = run(tmp_path, model, lambda m: validation(m, forward, back_to_train=False), forward)
    assert (f.evidence["cause"], f.step) == ("trained_in_eval", EVAL_AFTER)
    assert "bert.embeddings.dropout" in f.evidence["mode_modules"]
