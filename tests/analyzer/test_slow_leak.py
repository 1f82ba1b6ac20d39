"""Issue 37 (6): a slow leak, found by the census before memory shows it.

A forward hook keeps one stage's output of transformers' ResNet, with its graph, every step of an
80-step run: resident memory grows by well under the 16 MiB the memory rule needs after its
warm-up (the allocator's jumps dwarf it), and the census, within its time budget, counts only
twice; the count of tensors holding a graph still goes 2 -> 52 between the two. That is enough:
a healthy run holds the same few at every census. The same run without the hook stays quiet."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze

transformers = pytest.importorskip("transformers")


def _run(tmp_path, keep: bool):
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1], layer_type="basic",
        num_labels=8))
    kept = []
    if keep:  # the bug: a feature-visualisation hook that never clears what it keeps
        model.resnet.encoder.stages[1].register_forward_hook(lambda m, args, out: kept.append(out))

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 8, (32,), generator=g)

    train(model, tmp_path / "run", 80, batch, lambda out, y: F.cross_entropy(out.logits, y),
          optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return [f for f in analyze(load(tmp_path / "run")) if f.kind == "memory_leak"]


def test_a_hook_keeping_a_stage_output_is_a_leak_after_two_censuses(tmp_path):
    (f,) = _run(tmp_path, keep=True)
    assert f.evidence["series"] == "live_tensors_with_graph" and f.evidence["censuses"] >= 2
    assert 0.9 <= f.evidence["tensors_with_graph_per_step"] <= 1.1
    assert f.where and all(w.startswith("resnet.encoder.stages.1") for w in f.where), f.where
    assert _run(tmp_path / "twin", keep=False) == []
