"""Fresh scenarios, round 3, part c: healthy controls (split "fresh": written without reading the detectors
or their thresholds, held out from all tuning): one per family that round 3 brings in (ConvNeXt,
Swin, RegNet, DINOv2, ALBERT, DistilBERT, a Llama-style decoder, a ReLU RNN), each trained the
usual way (AdamW or SGD with warm-up and cosine decay, weight decay, clipping, bf16 autocast where
it fits) on a learnable synthetic task. The oracle, measured without torchautopsy: the loss finite
and falling, gradient norms (p.grad) finite and never surging, and (for the ReLU nets) no layer
with most of its units silent over a window of steps (our own hooks)."""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from .base import Activity, Oracle, grad_norms, hf, image_templates, record_loop, scenario, seed_all
from .fresh_round3a import _total
from .fresh_round3b import _adding_problem, _ReLURNN


def _warmup_cosine(opt, steps: int, warm: int):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))


def _bf16(model: nn.Module) -> nn.Module:
    """Autocast (bf16, CPU) around each forward, the model's own loss included (PyTorch AMP docs)."""
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    return model


def _grad_total(model: nn.Module) -> float:
    """The total gradient norm from p.grad (parameters the loss does not reach, e.g. DINOv2's
    mask token outside masked training, have none: left out)."""
    return _total({n: v for n, v in grad_norms(model).items() if model.get_parameter(n).grad is not None})


def _healthy(model, run_dir, batch, steps, opt, fall, loss_fn=None, warm=10, clip=1.0, relus=None, surge=10.0):
    """Train with warm-up + cosine decay and clipping; assert health: the loss finite, the last 20
    steps' mean under `fall` x the first 20's; every step's total gradient norm (p.grad, before
    clipping) finite and, after the first 20 steps, never over `surge` x the largest of those;
    the modules in `relus` (our own Activity hooks) never with over half their units silent in a
    50-step window."""
    total: list[float] = []
    act = Activity(relus) if relus else None

    def after_step(step, loss):
        if act is not None and (step + 1) % 50 == 0:
            act.end_window()

    losses = record_loop(model, run_dir, batch, steps, opt, loss_fn, clip=clip,
                         scheduler=_warmup_cosine(opt, steps, warm),
                         before_update=lambda s: total.append(_grad_total(model)), after_step=after_step)
    assert all(map(math.isfinite, losses + total)), "non-finite"
    assert sum(losses[-20:]) < fall * sum(losses[:20]), losses[::10]
    first, later = max(total[:20]), max(total[20:])
    assert later < surge * first, (later, first)
    ev = {"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
          "grad_norm_max_first20": first, "grad_norm_max_after": later, "grad_norm_median": statistics.median(total)}
    if act is not None:
        act.remove()
        worst = max(max(h) for h in act.history.values())
        assert worst < 0.5, act.history
        ev["worst_silent_unit_share_per_50_steps"] = worst
    return Oracle(None, evidence=ev)


def _images(g, noise=2.0, n=32, size=32):
    sample = image_templates(g, size)

    def batch(step):
        x, y = sample(n, noise)
        return {"pixel_values": x, "labels": y}, None

    return batch


def _first_word(g, V=64, T=32, n=32):
    """Padded token sequences; label: whether the first word after [CLS] is a "low" token (5..33)
    or a "high" one (34..63): attention must carry it to the [CLS] position."""

    def batch(step):
        lengths = torch.randint(8, T + 1, (n,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        ids = torch.randint(5, V, (n, T), generator=g)
        ids[:, 0] = 1
        ids = ids * mask
        return {"input_ids": ids, "attention_mask": mask, "labels": (ids[:, 1] < 34).long()}, None

    return batch


def _markov_lm(g, V=32, T=32, n=32):
    trans = torch.softmax(3.0 * torch.randn(V, V, generator=g), -1)  # a random Markov chain

    def batch(step):
        seq = torch.empty(n, T, dtype=torch.long)
        seq[:, 0] = torch.randint(0, V, (n,), generator=g)
        for t in range(T - 1):
            seq[:, t + 1] = torch.multinomial(trans[seq[:, t]], 1, generator=g)[:, 0]
        return {"input_ids": seq, "labels": seq}, None

    return batch


# -- vision ------------------------------------------------------------------------------------------

@scenario("fresh3_convnext_healthy_adamw_bf16", "convnext", None, "healthy",
          "ConvNeXt's recipe (Liu et al. 2022, 'A ConvNet for the 2020s'): AdamW, weight decay 0.05, linear "
          "warm-up then cosine decay, gradient clipping; forward in bf16 autocast (PyTorch AMP docs)", fresh=True)
def fresh3_convnext_healthy_adamw_bf16(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(620)
    model = _bf16(tf.ConvNextForImageClassification(tf.ConvNextConfig(
        num_channels=3, patch_size=2, hidden_sizes=[16, 32, 64], depths=[1, 1, 1], num_stages=3, num_labels=8,
        image_size=32)))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    return _healthy(model, run_dir, _images(g, 3.0), 150, opt, 0.5)


@scenario("fresh3_swin_healthy_adamw_warmup", "swin", None, "healthy",
          "Swin Transformer's recipe (Liu et al. 2021): AdamW, lr 1e-3, weight decay 0.05, linear warm-up then "
          "cosine decay, gradient clipping at 5; shifted-window attention on 32x32 images", fresh=True)
def fresh3_swin_healthy_adamw_warmup(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(621)
    model = tf.SwinForImageClassification(tf.SwinConfig(
        image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
        num_labels=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return _healthy(model, run_dir, _images(g, 2.0), 200, opt, 0.5, clip=5.0)


@scenario("fresh3_regnet_healthy_sgd_cosine_bf16", "regnet", None, "healthy",
          "RegNet's recipe (Radosavovic et al. 2020, 'Designing Network Design Spaces'): SGD, momentum 0.9, "
          "weight decay 5e-5, warm-up then cosine decay; RegNetX blocks (BatchNorm and ReLU throughout, no "
          "squeeze-excitation); bf16 autocast", fresh=True)
def fresh3_regnet_healthy_sgd_cosine_bf16(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(622)
    model = _bf16(tf.RegNetForImageClassification(tf.RegNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1], groups_width=8,
        layer_type="x", num_labels=8)))
    relus = {n: m for n, m in model.named_modules() if isinstance(m, nn.ReLU)}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-5)
    return _healthy(model, run_dir, _images(g, 3.0), 200, opt, 0.5, clip=None, relus=relus)


@scenario("fresh3_dinov2_healthy_classifier_layerscale", "dinov2", None, "healthy",
          "a DINOv2 backbone (Oquab et al. 2023; LayerScale, Touvron et al. 2021) trained as a classifier "
          "(Dinov2ForImageClassification: CLS token and mean patch token to a linear head) with AdamW, weight "
          "decay 0.05, warm-up then cosine decay, gradient clipping", fresh=True)
def fresh3_dinov2_healthy_classifier_layerscale(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(623)
    model = tf.Dinov2ForImageClassification(tf.Dinov2Config(
        image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        mlp_ratio=2, num_labels=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return _healthy(model, run_dir, _images(g, 2.0), 200, opt, 0.5)


# -- text ----------------------------------------------------------------------------------------

@scenario("fresh3_albert_healthy_shared_layers", "albert", None, "healthy",
          "ALBERT (Lan et al. 2020): factorised embeddings and one Transformer layer shared by all 4 "
          "applications, trained as a token tagger (a tag that depends on the token and its predecessor) with "
          "AdamW, weight decay 0.01, warm-up then cosine decay, clipping at 1 (the usual BERT recipe)", fresh=True)
def fresh3_albert_healthy_shared_layers(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(624)
    model = tf.AlbertForTokenClassification(tf.AlbertConfig(
        vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2, pad_token_id=0, classifier_dropout_prob=0.0))
    words = _first_word(g)

    def batch(step):  # tag 1: a "low" token (5..33) after a "low" token; padding and [CLS] untagged (-100)
        x, _ = words(step)
        low = (x["input_ids"] < 34).long()
        tags = torch.where(x["attention_mask"].bool(), low & torch.roll(low, 1, 1), torch.full_like(low, -100))
        tags[:, :2] = -100
        return {**x, "labels": tags}, None

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return _healthy(model, run_dir, batch, 400, opt, 0.7)


@scenario("fresh3_distilbert_healthy_adamw_warmup", "distilbert", None, "healthy",
          "DistilBERT (Sanh et al. 2019) trained as a sequence classifier the usual way: AdamW at lr 5e-4 "
          "(small model from scratch; fine-tuning uses 2e-5 to 5e-5), weight decay 0.01, linear warm-up then "
          "cosine decay, clipping at 1", fresh=True)
def fresh3_distilbert_healthy_adamw_warmup(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(625)
    model = tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32, num_labels=2))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    return _healthy(model, run_dir, _first_word(g), 300, opt, 0.7)


@scenario("fresh3_llama_healthy_lm_bf16", "llama", None, "healthy",
          "a Llama-style decoder (Touvron et al. 2023: RMSNorm, SwiGLU, rotary positions, grouped-query "
          "attention) trained as a language model the way Llama was: AdamW betas (0.9, 0.95), weight decay "
          "0.1, warm-up then cosine decay, clipping at 1.0; forward in bf16 autocast", fresh=True)
def fresh3_llama_healthy_lm_bf16(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(626)
    model = _bf16(tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return _healthy(model, run_dir, _markov_lm(g), 200, opt, 0.75)


# -- recurrent -----------------------------------------------------------------------------------

@scenario("fresh3_irnn_healthy_adding_problem", "rnn", None, "healthy",
          "the IRNN as published (Le, Jaitly & Hinton 2015: a ReLU RNN with identity recurrent weights and "
          "zero biases) on the adding problem (Hochreiter & Schmidhuber 1997), Adam with clipping at 1, "
          "warm-up then cosine decay", fresh=True)
def fresh3_irnn_healthy_adding_problem(run_dir: str) -> Oracle:
    g = seed_all(627)
    task = _adding_problem(g, 16)
    model = _ReLURNN()
    with torch.no_grad():
        model.rnn.weight_hh_l0.copy_(torch.eye(64))
        model.rnn.bias_hh_l0.zero_()
        model.rnn.bias_ih_l0.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return _healthy(model, run_dir, task, 300, opt, 0.3, loss_fn=F.mse_loss)
