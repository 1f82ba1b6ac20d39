"""Issue 37 (7): healthy modern vision models stay quiet.

transformers' ConvNeXt (LayerScale gains of 1e-6 inside its blocks, its stem and downsampling
convolutions outside them) and MobileNetV2 (depthwise and pointwise convolutions, BatchNorm
everywhere) have early-layer gradients 200-250,000x their late ones' by design while their loss
falls 100x; the across-depth exploding rule once made that the report's headline. Trained here as
people train them (AdamW, warm-up) on a learnable task, with the default Recorder: no
warning, no error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze

transformers = pytest.importorskip("transformers")


def _model(name: str):
    torch.manual_seed(0)
    if name == "convnext":
        return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
            num_channels=3, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_labels=4, image_size=32))
    return transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
        num_channels=3, image_size=32, depth_multiplier=0.35, num_labels=4))


@pytest.mark.parametrize("name", ["convnext", "mobilenetv2"])
def test_a_healthy_modern_vision_model_has_no_warning(name, tmp_path):
    model = _model(name)
    g = torch.Generator().manual_seed(0)
    prototypes = torch.randn(4, 3, 32, 32, generator=g)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        y = torch.randint(0, 4, (32,), generator=g)
        return prototypes[y] + 0.5 * torch.randn(32, 3, 32, 32, generator=g), y

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    train(model, tmp_path / "run", 80, batch, lambda out, y: F.cross_entropy(out.logits, y), optimizer=opt,
          after_update=lambda step, loss: warmup.step())
    problems = [(f.kind, f.summary) for f in analyze(load(tmp_path / "run")) if f.severity != "info"]
    assert problems == []
