"""input_data (issue 27): the batch as the model receives it, recorded every step, and what is
wrong with it, planted the way data pipelines break: images left in 0..255, tabular features in
raw units, a blank batch from a failed read, a shard in other units mid-run; a transformers ViT
gets its pixel_values as a keyword. Normalised inputs stay quiet, and so do token ids."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.training import train
from torchautopsy import load
from torchautopsy.analyzer.run import analyze

STEPS = 60


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def images(step: int, scale=lambda s: 1.0, blank=()):
    """A batch of 'images': uint8-like values 0..255 times scale(step), or normalised ones (scale None)."""
    g = torch.Generator().manual_seed(step)
    raw = torch.randint(0, 256, (8, 3, 8, 8), generator=g).float()
    x = (raw / 255 - 0.45) / 0.25 if scale is None else raw * scale(step)
    if step in blank:
        x = torch.zeros_like(x)
    return x, torch.randint(0, 4, (8,), generator=g)


def found(tmp_path, model, batch, loss=F.cross_entropy, steps=STEPS):
    train(model, tmp_path / "run", steps, batch, loss, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
          activations_every=10)
    return {f.evidence["cause"]: f for f in analyze(load(tmp_path / "run")) if f.kind == "input_data"}


def test_images_left_in_0_to_255_are_not_normalised(tmp_path):
    got = found(tmp_path, cnn(), images)
    assert set(got) == {"unnormalized"}
    f = got["unnormalized"]
    assert (f.severity, f.step) == ("warning", 0)
    assert f.evidence["max"] == 255 and 100 < f.evidence["mean"] < 150 and "Normalize" in f.advice
    rt = load(tmp_path / "run").ranks[0]
    assert (rt.columns["input_max"].to_numpy() == 255).all()  # (every step's batch, not only watched ones)


def test_normalised_images_are_quiet(tmp_path):
    assert found(tmp_path, cnn(), lambda s: images(s, None)) == {}


def test_a_blank_batch_from_a_failed_read_is_dated(tmp_path):
    got = found(tmp_path, cnn(), lambda s: images(s, None, blank=(23,)))
    f = got["constant_batch"]
    assert (f.step, f.evidence["constant_steps"], f.evidence["constant_value"]) == (23, [23], 0.0)
    assert set(got) == {"constant_batch"}


def test_a_shard_in_other_units_mid_run_is_a_shift_at_its_first_step(tmp_path):
    """From step 37 the pipeline stops normalising: the batch's mean and std jump."""
    def batch(step):
        return images(step, None) if step < 37 else images(step, lambda s: 1 / 255)
    got = found(tmp_path, cnn(), batch)
    f = got["shift"]
    assert (f.severity, f.step) == ("warning", 37)
    assert 0.1 < f.evidence["before"]["mean"] < 0.3 and 0.4 < f.evidence["after"]["mean"] < 0.6  # ((0.5 - 0.45) / 0.25; 0.5)


def test_tabular_features_in_raw_units_have_wildly_different_scales(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    scales = torch.tensor([1.0, 0.01, 3.0, 0.5])  # a ratio, a fraction, ... all about 1: quiet
    raw = torch.tensor([1.0, 2e5, 30.0, 0.001])  # an index, a price in $, an age, a rate: raw units

    def batch(scale):
        def make(step):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 4, generator=g) * scale
            return x, x.sum(1, keepdim=True)
        return make
    mse = lambda out, y: F.mse_loss(out, y)  # noqa: E731
    assert found(tmp_path / "ok", model, batch(scales), mse, steps=30) == {}
    got = found(tmp_path / "raw", model, batch(raw), mse, steps=30)
    assert got["feature_scales"].evidence["feature_std_ratio"] > 1e7
    assert "unnormalized" in got  # (a std of 1e5: not normalised either)


def test_a_vit_gets_its_pixel_values_as_a_keyword(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32,
                                                num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                                num_labels=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    from torchautopsy import Recorder
    with Recorder(model, tmp_path / "run") as rec:
        for step in range(25):
            g = torch.Generator().manual_seed(step)
            pixels = torch.randint(0, 256, (4, 3, 16, 16), generator=g).float()  # the processor was skipped
            loss = model(pixel_values=pixels, labels=torch.tensor([0, 1, 2, 3])).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    got = {f.evidence["cause"]: f for f in analyze(load(tmp_path / "run")) if f.kind == "input_data"}
    assert got["unnormalized"].evidence["max"] == 255


def test_token_ids_have_no_statistics(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=200, num_labels=2))
    ids = torch.randint(0, 200, (4, 12))
    train(model, tmp_path / "run", 6, lambda s: (ids, torch.tensor([0, 1, 0, 1])),
          lambda out, y: F.cross_entropy(out.logits, y))
    rt = load(tmp_path / "run").ranks[0]
    assert rt.columns["input_mean"].isna().all()
    assert [f for f in analyze(load(tmp_path / "run")) if f.kind == "input_data"] == []
