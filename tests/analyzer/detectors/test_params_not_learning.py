"""params_not_learning (issue 27): each way people leave a parameter untrained, planted the way
they make it in a real model trained for a few steps, told apart by its cause; and the healthy
recipes that look alike (a frozen backbone, intended gradient accumulation, a BERT fine-tuned
by its head) stay quiet."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze

STEPS = 16


class Net(nn.Module):
    """A small CNN classifier, its head called `fc` as torchvision's are."""

    def __init__(self, aux: bool = False, detach: bool = False, gate: bool = False):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.branch = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 4) if aux else None  # defined, never called
        self.detach, self.gate = detach, gate
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.features(x)
        b = self.branch(h)
        if self.detach:
            b = b.detach()  # the bug: the branch's features are used, its weights never learn
        if self.gate:
            b = b * torch.zeros_like(b)  # an all-zero mask: the branch's gradient is exactly 0
        return self.fc(h + b)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def findings(tmp_path, model, optimizer=None, **kw):
    train(model, tmp_path / "run", STEPS, batch, F.cross_entropy, optimizer=optimizer, activations_every=5, **kw)
    return [f for f in analyze(load(tmp_path / "run")) if f.kind == "params_not_learning"]


def test_a_head_replaced_after_the_optimizer_was_made_is_in_no_optimizer(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.fc = nn.Linear(8, 4)  # the fine-tuning recipe done in the wrong order
    (f,) = findings(tmp_path, model, opt)
    assert (f.severity, f.evidence["cause"]) == ("error", "not_in_optimizer")
    assert f.where == ["fc.weight", "fc.bias"] and f.evidence["steps_with_gradient"] == STEPS
    assert "add_param_group" in f.advice


def test_a_layer_defined_and_never_called_is_unused(tmp_path):
    torch.manual_seed(0)
    (f,) = findings(tmp_path, Net(aux=True))
    assert (f.severity, f.evidence["cause"], f.where) == ("warning", "unused", ["aux.weight", "aux.bias"])
    assert f.evidence["module_ran"] is False


def test_a_branch_cut_by_detach_is_detached_not_unused(tmp_path):
    torch.manual_seed(0)
    (f,) = findings(tmp_path, Net(detach=True))
    assert (f.severity, f.evidence["cause"], f.where) == ("warning", "detached", ["branch.weight", "branch.bias"])
    assert f.evidence["module_ran"] is True and ".detach()" in f.advice


def test_a_branch_behind_an_all_zero_mask_has_a_zero_gradient(tmp_path):
    torch.manual_seed(0)
    (f,) = findings(tmp_path, Net(gate=True))
    assert (f.severity, f.evidence["cause"], f.where) == ("warning", "zero_gradient", ["branch.weight", "branch.bias"])


def test_a_freezing_pattern_that_also_froze_the_head_is_a_warning(tmp_path):
    torch.manual_seed(0)
    model = Net()
    for name, p in model.named_parameters():
        if not name.startswith("branch"):  # meant: freeze the features; froze fc as well
            p.requires_grad_(False)
    (f,) = findings(tmp_path, model)
    assert (f.severity, f.evidence["cause"]) == ("warning", "frozen_in_optimizer")
    assert "fc.weight" in f.evidence["params"] and f.evidence["first_trained_before"] == "branch.weight"


def test_a_frozen_model_whose_new_head_came_after_the_optimizer_learns_nothing(tmp_path):
    """Transfer learning in the wrong order: freeze, make the optimizer, then replace the head.
    Every parameter the optimizer steps is frozen, and the head it should step is in none."""
    torch.manual_seed(0)
    model = Net()
    model.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.fc = nn.Linear(8, 4)
    found = {f.evidence["cause"]: f for f in findings(tmp_path, model, opt)}
    assert set(found) == {"frozen_in_optimizer", "not_in_optimizer"}
    assert (found["frozen_in_optimizer"].severity, found["frozen_in_optimizer"].evidence["trained_params"]) == \
        ("error", 0)
    assert found["not_in_optimizer"].where == ["fc.weight", "fc.bias"]


def test_a_frozen_backbone_is_quiet_filtered_and_info_handed_over(tmp_path):
    torch.manual_seed(0)
    model = Net()
    model.features.requires_grad_(False)
    assert findings(tmp_path / "filtered", model,
                    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)) == []
    (f,) = findings(tmp_path / "whole", model, torch.optim.SGD(model.parameters(), lr=0.05))
    assert (f.severity, f.evidence["cause"]) == ("info", "frozen_in_optimizer")


def test_intended_gradient_accumulation_is_quiet(tmp_path):
    from torchautopsy import Recorder

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(model, tmp_path / "run", activations_every=5) as rec:
        for step in range(STEPS):
            for micro in range(4):
                x, y = batch(step * 4 + micro)
                (F.cross_entropy(model(x), y) / 4).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    assert [f for f in analyze(load(tmp_path / "run")) if f.severity != "info"] == []


def test_bert_fine_tuned_by_its_head_with_the_encoder_frozen_is_quiet(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200, num_labels=3))
    model.bert.requires_grad_(False)
    ids = torch.randint(0, 200, (4, 12))

    def bert_batch(step):
        return ids.roll(step, 1), torch.tensor([0, 1, 2, step % 3])

    train(model, tmp_path / "run", STEPS, bert_batch, lambda out, y: F.cross_entropy(out.logits, y),
          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), activations_every=5)
    found = [f for f in analyze(load(tmp_path / "run")) if f.kind == "params_not_learning"]
    assert [(f.severity, f.evidence["cause"]) for f in found] == [("info", "frozen_in_optimizer")]
    assert found[0].evidence["n_params"] == len(list(model.bert.parameters()))


def test_bert_whose_classifier_was_replaced_after_the_optimizer_was_made(tmp_path):
    """The same mistake in a transformers model: num_labels changed by swapping the head after
    AdamW was given the model's parameters."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200, num_labels=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.classifier = nn.Linear(32, 3)
    ids = torch.randint(0, 200, (4, 12))
    train(model, tmp_path / "run", STEPS, lambda step: (ids.roll(step, 1), torch.tensor([0, 1, 2, step % 3])),
          lambda out, y: F.cross_entropy(out.logits, y), optimizer=opt, activations_every=5)
    (f,) = [f for f in analyze(load(tmp_path / "run")) if f.kind == "params_not_learning"]
    assert (f.severity, f.evidence["cause"], f.where) == ("error", "not_in_optimizer",
                                                          ["classifier.weight", "classifier.bias"])
    assert f.step == 0 and "BertForSequenceClassification.forward" in f.evidence["code"]["classifier.weight"]


def test_a_parameter_the_forward_does_not_use_while_its_module_learns_is_info(tmp_path):
    """transformers' DINOv2 fine-tuned as a classifier: its embeddings' mask_token serves masked
    inputs only and never gets a gradient while cls_token and position_embeddings (the same
    module's) learn: a branch not taken, an info (it was a warning on every healthy run)."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    torch.manual_seed(0)
    model = Dinov2ForImageClassification(Dinov2Config(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                                      num_attention_heads=2, intermediate_size=32, num_labels=4))
    train(model, tmp_path / "run", STEPS, batch, lambda out, y: F.cross_entropy(out.logits, y))
    (f,) = [f for f in analyze(load(tmp_path / "run")) if f.kind == "params_not_learning"]
    assert (f.severity, f.evidence["cause"], f.where) == ("info", "not_used", ["dinov2.embeddings.mask_token"])
