"""missing_zero_grad (issue 27): a loop that never clears its gradients, planted in real models as
people write it (the zero_grad() line left out), against the loops that look alike and are
healthy: gradient accumulation that clears after each optimizer step, zero_grad(set_to_none=False)
(the same tensors, zeroed in place), and gradients that explode in such a loop for another reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder, load
from torchautopsy.analyzer.run import analyze

STEPS = 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4].argmax(dim=1))


def run(tmp_path, model, opt, clear, micro: int = 1, lr_at=None):
    """Train; clear(opt, model) runs after each optimizer step (None: never: the bug)."""
    with Recorder(model, tmp_path / "run", activations_every=5) as rec:
        for step in range(STEPS):
            if lr_at is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
            for k in range(micro):
                x, y = batch(step * micro + k)
                loss = F.cross_entropy(model(x), y) / micro
                loss.backward()
            opt.step()
            rec.step(loss=loss)
            if clear is not None:
                clear(opt, model)
    return [f for f in analyze(load(tmp_path / "run")) if f.kind == "missing_zero_grad"]


def test_an_sgd_loop_without_zero_grad_is_found_at_its_second_step(tmp_path):
    model = mlp()
    (f,) = run(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.01), clear=None)
    assert (f.severity, f.step) == ("error", 1)
    assert f.evidence["kept_share"] == 1.0 and f.evidence["growth"] >= 3 and "zero_grad()" in f.advice


@pytest.mark.slow  # transformers
def test_bert_fine_tuned_with_adamw_and_no_zero_grad_is_found(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200, num_labels=3))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    ids = torch.randint(0, 200, (8, 16))
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    with Recorder(model, tmp_path / "run", activations_every=5) as rec:
        for step in range(STEPS):
            loss = model(input_ids=ids.roll(step, 1), labels=labels).loss
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    (f,) = [f for f in analyze(load(tmp_path / "run")) if f.kind == "missing_zero_grad"]
    assert (f.severity, f.step) == ("error", 1)


def test_accumulation_cleared_after_each_optimizer_step_is_quiet(tmp_path):
    model = mlp()
    assert run(tmp_path, model, torch.optim.AdamW(model.parameters(), lr=1e-3), micro=4,
               clear=lambda opt, m: opt.zero_grad()) == []
    assert set(load(tmp_path / "run").ranks[0].columns["grads_kept"].to_numpy().tolist()) == {0}


def test_zeroed_in_place_is_kept_but_quiet(tmp_path):
    model = mlp()
    assert run(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.01),
               clear=lambda opt, m: opt.zero_grad(set_to_none=False)) == []
    kept = load(tmp_path / "run").ranks[0].columns["grads_kept"].to_numpy()
    assert kept[0] == 0 and (kept[1:] == 1).all()  # the same tensors: the recorder cannot tell more


def test_gradients_exploding_in_a_loop_that_zeroes_in_place_are_not_called_a_missing_zero_grad(tmp_path):
    """An lr that climbs 1.5x a step: the gradients explode, exponentially, not as a sum grows."""
    model = mlp()
    found = run(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.01), lr_at=lambda s: 0.05 * 1.5 ** s,
                clear=lambda opt, m: opt.zero_grad(set_to_none=False))
    assert found == []
    others = {f.kind for f in analyze(load(tmp_path / "run")) if f.severity in ("warning", "error")}
    assert others & {"exploding_gradients", "loss_divergence", "nonfinite"}, others
