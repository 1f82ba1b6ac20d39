"""ViT scenarios: transformers' ViTForImageClassification from a tiny ViTConfig (16x16 images,
4x4 patches, hidden 32, 2 layers, 2 heads), random init, on synthetic images (class templates
plus noise); both attention implementations ("eager" and "sdpa") are used. The attention oracle
is a separate eager copy of the model (same weights, loaded before each look) run with
output_attentions=True under no_grad on a fixed probe batch, so that the recorded model sees no
extra forward passes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import Oracle, attention_entropy, record_loop, scenario, seed_all

N_CLASSES = 8


def _config(impl: str, **kw):
    from transformers import ViTConfig

    return ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, num_labels=N_CLASSES, attn_implementation=impl, **kw)


def _vit(impl: str, **kw):
    from transformers import ViTForImageClassification

    return ViTForImageClassification(_config(impl, **kw))


def _data(g: torch.Generator, n: int = 32, noise: float = 1.5):
    """Each class a smooth random 3x16x16 template, plus white noise; and a fixed probe batch."""
    tpl = F.avg_pool2d(torch.randn(N_CLASSES, 3, 20, 20, generator=g), 5, 1)
    tpl = tpl / tpl.std()

    def sample(m):
        y = torch.randint(0, N_CLASSES, (m,), generator=g)
        return tpl[y] + noise * torch.randn(m, 3, 16, 16, generator=g), y

    probe_x, _ = sample(16)

    def batch(step: int):
        x, y = sample(n)
        return {"pixel_values": x, "labels": y}, y

    return batch, probe_x


class AttentionProbe:
    """Per layer: the mean normalised entropy of the attention rows (1 uniform, 0 one-hot) and the
    mean of each row's largest weight, as an eager copy of the model returns them."""

    def __init__(self, model, probe_x: torch.Tensor):
        from transformers import ViTForImageClassification

        cfg = model.config.to_dict()
        cfg["attn_implementation"] = "eager"
        self.copy = ViTForImageClassification(type(model.config).from_dict(cfg)).eval()
        self.model, self.x = model, probe_x
        self.names = [f"vit.layers.{i}.attention" for i in range(len(model.vit.layers))]

    def __call__(self):
        self.copy.load_state_dict(self.model.state_dict())
        with torch.no_grad():
            att = self.copy(pixel_values=self.x, output_attentions=True).attentions
        return ([attention_entropy(a) for a in att], [float(a.amax(-1).mean()) for a in att])


def _total(model) -> float:
    return math.sqrt(sum(float(p.grad.detach().norm()) ** 2 for p in model.parameters() if p.grad is not None))


@scenario("vit_healthy_warmup_cosine", "vit", None, "healthy",
          "the usual ViT recipe (Dosovitskiy et al. 2021; Steiner et al. 2022, 'How to train your ViT'): "
          "pre-LayerNorm blocks, dropout, AdamW with weight decay, linear warm-up then cosine decay, "
          "gradient clipping at global norm 1")
def vit_healthy_warmup_cosine(run_dir: str) -> Oracle:
    g = seed_all(20)
    model = _vit("eager", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    batch, probe_x = _data(g)
    probe = AttentionProbe(model, probe_x)
    steps, warm = 200, 20
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    ent, mx, gn = [], [], []

    def after_step(step, loss):
        if step % 5 == 0 or step == steps - 1:
            e, m = probe()
            ent.append(e)
            mx.append(m)

    losses = record_loop(model, run_dir, batch, steps, opt, clip=1.0, scheduler=sched,
                         before_update=lambda s: gn.append(_total(model)), after_step=after_step)
    # The oracle of health: loss falls clearly, everything finite, gradients bounded, and no layer's
    # attention is near one-hot (mean normalised entropy stays > 0.3, mean max weight < 0.9).
    min_ent = min(min(e) for e in ent)
    max_mx = max(max(m) for m in mx)
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.6 * sum(losses[:20]), losses[::20]
    assert all(map(math.isfinite, gn)) and max(gn) < 20 * sorted(gn)[len(gn) // 2], gn[::20]
    assert min_ent > 0.3 and max_mx < 0.9, (min_ent, max_mx)
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "min_layer_entropy": min_ent, "max_layer_mean_max_weight": max_mx,
                                  "grad_norm_max": max(gn), "grad_norm_median": sorted(gn)[len(gn) // 2]})


@scenario("vit_qk_init_x50_collapse", "vit", "attention_collapse", "init",
          "attention entropy collapse (Zhai et al. 2023, 'Stabilizing Transformer Training by Preventing "
          "Attention Entropy Collapse'): query/key weights initialised 50x too large make the logits' "
          "scale huge and the softmax one-hot from the first step")
def vit_qk_init_x50_collapse(run_dir: str) -> Oracle:
    g = seed_all(21)
    model = _vit("eager")
    with torch.no_grad():
        for layer in model.vit.layers:  # a bad init: q and k weights 50x the ViT's std 0.02
            layer.attention.q_proj.weight.mul_(50.0)
            layer.attention.k_proj.weight.mul_(50.0)
    batch, probe_x = _data(g)
    probe = AttentionProbe(model, probe_x)
    ent0, mx0 = probe()  # what the first step's forward sees
    ent, mx = [ent0], [mx0]

    def after_step(step, loss):
        if (step + 1) % 10 == 0:
            e, m = probe()
            ent.append(e)
            mx.append(m)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 120, opt, after_step=after_step)
    # The oracle: a layer is collapsed when its mean normalised attention entropy on the probe
    # batch is < 0.1 (and its rows' mean largest weight > 0.9); step = the first probe (before
    # step 0) at which it holds; where = the layers collapsed there. It holds at every probe.
    where = [n for n, e, m in zip(probe.names, ent0, mx0) if e < 0.1 and m > 0.9]
    assert where == probe.names, (ent0, mx0)
    assert all(e < 0.1 for es in ent for e in es), ent
    assert all(map(math.isfinite, losses))
    return Oracle("attention_collapse", step=0, where=where, step_tolerance=10,
                  evidence={"entropy_at_init": ent0, "mean_max_weight_at_init": mx0,
                            "max_entropy_over_run": max(max(e) for e in ent), "qk_scale": 50.0})


@scenario("vit_sdpa_lr_jump_collapse", "vit", "attention_collapse", "mid",
          "attention entropy collapse arising during training when the learning rate is too high (Zhai et "
          "al. 2023; Dehghani et al. 2023, 'Scaling Vision Transformers to 22B', attention-logit growth)")
def vit_sdpa_lr_jump_collapse(run_dir: str) -> Oracle:
    g = seed_all(22)
    model = _vit("sdpa")
    batch, probe_x = _data(g)
    probe = AttentionProbe(model, probe_x)
    jump, steps = 100, 170
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    ent, mx = [], []

    def after_step(step, loss):
        if step + 1 == jump:
            for group in opt.param_groups:  # the lr jumps 30x (a schedule bug) from step 100 on
                group["lr"] *= 30.0
        e, m = probe()  # the weights the NEXT step's forward uses
        ent.append(e)
        mx.append(m)

    e0, m0 = probe()
    ent.insert(0, e0)
    mx.insert(0, m0)
    losses = record_loop(model, run_dir, batch, steps, opt, after_step=after_step)
    ent, mx = ent[:steps], mx[:steps]  # ent[s]: what step s's forward saw
    # The oracle: the first step whose forward has some layer's mean normalised attention entropy
    # < 0.1 on the probe batch; where = the layers below 0.1 at that step (the same layers stay
    # below 0.1 for most of the rest of the run).
    # where = every layer whose entropy falls below 0.1 at some step of the run (each does so
    # after the jump only).
    step = next(s for s in range(steps) if min(ent[s]) < 0.1)
    where = [n for i, n in enumerate(probe.names) if any(e[i] < 0.1 for e in ent)]
    before = min(min(e) for e in ent[:jump])
    after = [min(e) for e in ent[step:]]
    assert before > 0.5 and step > jump, (before, step)
    assert sum(a < 0.1 for a in after) > 0.8 * len(after), after
    assert all(map(math.isfinite, losses))
    return Oracle("attention_collapse", step=step, where=where, step_tolerance=10,
                  evidence={"min_entropy_before_jump": before, "entropy_at_step": ent[step],
                            "mean_max_weight_at_step": mx[step],
                            "entropy_at_end": ent[-1], "mean_max_weight_at_end": mx[-1],
                            "first_step_below_0.1_per_layer": [next((s for s in range(steps) if ent[s][i] < 0.1), None)
                                                               for i in range(len(probe.names))],
                            "share_of_steps_after_onset_below_0.1_per_layer":
                                [sum(e[i] < 0.1 for e in ent[step:]) / len(ent[step:]) for i in range(len(probe.names))],
                            "min_layer_entropy_every_10": [min(ent[s]) for s in range(0, steps, 10)]})


@scenario("vit_sdpa_lr_jump_explodes", "vit", "exploding_gradients", "mid",
          "exploding gradients and divergence after the learning rate jumps too high (Pascanu, Mikolov & "
          "Bengio 2013; Goodfellow et al. 2016, ch. 8.2.4 'cliffs and exploding gradients')")
def vit_sdpa_lr_jump_explodes(run_dir: str) -> Oracle:
    g = seed_all(23)
    model = _vit("sdpa")
    batch, _ = _data(g)
    jump, steps = 100, 130
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gn, per = [], []

    def before_update(step):
        if step == jump:
            for group in opt.param_groups:  # the lr jumps 20x (0.05 -> 1.0) from step 100 on
                group["lr"] *= 20.0
        gn.append(_total(model))
        per.append({n: float(p.grad.norm()) for n, p in model.named_parameters()})

    losses = record_loop(model, run_dir, batch, steps, opt, before_update=before_update)
    # The oracle: the first step whose global gradient norm (from p.grad, before the update)
    # exceeds 10x the median of the 50 steps before the jump; where = the parameters whose own
    # gradient norm exceeds 10x their own pre-jump median at that step.
    ref = sorted(gn[jump - 50:jump])[25]
    step = next(s for s in range(jump, steps) if math.isfinite(gn[s]) and gn[s] > 10 * ref)
    assert all(g_ < 10 * ref for g_ in gn[:jump]), max(gn[:jump])
    where = []
    for n in per[0]:
        own = sorted(p[n] for p in per[jump - 50:jump])[25]
        if per[step][n] > 10 * own:
            where.append(n)
    peak = max(x for x in gn if math.isfinite(x))
    assert peak > 100 * ref, (peak, ref)
    return Oracle("exploding_gradients", step=step, where=where, step_tolerance=2,
                  evidence={"pre_jump_median_grad_norm": ref, "grad_norm_at_step": gn[step], "peak_grad_norm": peak,
                            "grad_norms_from_jump": gn[jump:jump + 15],
                            "first_nonfinite_loss_step": next((i for i, v in enumerate(losses)
                                                               if not math.isfinite(v)), None)})
