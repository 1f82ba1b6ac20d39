"""ResNet scenarios: transformers' ResNetForImageClassification (the real ResNet implementation,
basic blocks with BatchNorm) from a tiny ResNetConfig, random init, on synthetic 3x16x16 images
(class templates plus noise). torchvision cannot be used here; transformers' ResNet stands in."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Activity, Oracle, record_loop, scenario, seed_all

N_CLASSES = 8


def _resnet(n_classes: int = N_CLASSES):
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                       num_labels=n_classes)
    return ResNetForImageClassification(cfg)


def _images(g: torch.Generator, n: int = 32, noise: float = 3.0):
    """Synthetic classification: each class a smooth random 3x16x16 template, plus white noise."""
    tpl = F.avg_pool2d(torch.randn(N_CLASSES, 3, 20, 20, generator=g), 5, 1)
    tpl = tpl / tpl.std()

    def batch(step: int):
        y = torch.randint(0, N_CLASSES, (n,), generator=g)
        return {"pixel_values": tpl[y] + noise * torch.randn(n, 3, 16, 16, generator=g), "labels": y}, y

    return batch


def _finite_loss_falls(losses, frac=0.6):
    return all(map(math.isfinite, losses)) and sum(losses[-20:]) < frac * sum(losses[:20])


@scenario("resnet_healthy_adamw_cosine", "resnet", None, "healthy",
          "the usual ResNet recipe: BatchNorm (Ioffe & Szegedy 2015), AdamW with decoupled weight decay, "
          "linear warm-up then cosine decay (Loshchilov & Hutter 2017, 2019; Goyal et al. 2017)")
def resnet_healthy_adamw_cosine(run_dir: str) -> Oracle:
    g = seed_all(10)
    model = _resnet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    steps, warm = 200, 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    relus = {n: m for n, m in model.named_modules() if isinstance(m, nn.ReLU)}
    act = Activity(relus)
    gmax = []

    def before_update(step):
        gmax.append(math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model.parameters())))

    def after_step(step, loss):
        if (step + 1) % 50 == 0:
            act.end_window()

    losses = record_loop(model, run_dir, _images(g), steps, opt, scheduler=sched, before_update=before_update,
                         after_step=after_step)
    act.remove()
    # The oracle of health: the loss falls clearly and stays finite, gradients finite and bounded,
    # no ReLU layer has a majority of its channels dead in any 50-step window.
    worst_dead = max(max(h) for h in act.history.values())
    assert _finite_loss_falls(losses), losses[::20]
    assert all(map(math.isfinite, gmax)) and max(gmax) < 20 * sorted(gmax)[len(gmax) // 2], gmax[::20]
    assert worst_dead < 0.5, act.history
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "grad_norm_max": max(gmax), "grad_norm_median": sorted(gmax)[len(gmax) // 2],
                                  "worst_dead_channel_share": worst_dead})


@scenario("resnet_bn_beta_dead_init", "resnet", "dead_relu", "init",
          "dead ReLUs from initialisation: a large negative bias before the ReLU leaves units that never fire "
          "and never get a gradient (Lu et al. 2019, 'Dying ReLU and Initialization'; CS231n notes); in a ResNet "
          "the BatchNorm's beta is that bias")
def resnet_bn_beta_dead_init(run_dir: str) -> Oracle:
    g = seed_all(11)
    model = _resnet()
    layer = "resnet.encoder.stages.0.layers.0.layer.0"
    bn = model.get_submodule(layer + ".normalization")
    n_dead = 12  # of its 16 channels
    with torch.no_grad():
        bn.bias[:n_dead] = -10.0  # a bad init of the BN shift: beta = -10 on 12 channels
    relu_name = layer + ".activation"
    act = Activity({relu_name: model.get_submodule(relu_name)})
    window, steps = 25, 150
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    def after_step(step, loss):
        if (step + 1) % window == 0:
            act.end_window()

    losses = record_loop(model, run_dir, _images(g), steps, opt, after_step=after_step)
    act.remove()
    # The oracle: the share of the ReLU's channels never positive (over a whole 25-step window of
    # training batches) is >= 12/16 in every window, from the first on; step = 0 (dead from init).
    hist = act.history[relu_name]
    assert all(h >= n_dead / 16 - 1e-6 for h in hist), hist
    assert all(map(math.isfinite, losses))
    return Oracle("dead_relu", step=0, where=[relu_name, layer + ".normalization", layer], step_tolerance=50,
                  evidence={"dead_share_per_25_step_window": hist, "beta": -10.0, "dead_channels": n_dead})


@scenario("resnet_nodata_fill_inf", "resnet", "nonfinite", "mid",
          "a bad record: a float32 raster whose no-data pixels hold -3.4028235e38 (the usual float32 GeoTIFF/"
          "ESRI no-data value) enters the batch unmasked; the first conv's sums overflow to +/-Inf (IEEE 754)")
def resnet_nodata_fill_inf(run_dir: str) -> Oracle:
    g = seed_all(12)
    model = _resnet()
    base = _images(g)
    bad_step = 90
    nodata = float(torch.finfo(torch.float32).min)  # -3.4028235e38: finite

    def batch(step):
        x, y = base(step)
        if step == bad_step:
            x["pixel_values"][5, :, 3:13, 2:12] = nodata  # one image with an unmasked no-data block
        return x, y

    conv_name = "resnet.embedder.embedder.convolution"
    seen, cur = {}, [0]

    # The oracle: the first step at which the first conv's OUTPUT holds a non-finite value while
    # its input is all finite (our forward hook).
    def hook(module, args, out):
        if torch.is_grad_enabled() and "step" not in seen and torch.isfinite(args[0]).all() \
                and not torch.isfinite(out).all():
            seen["step"] = cur[0]
            seen["pos_inf"] = int(torch.isposinf(out).sum())
            seen["neg_inf"] = int(torch.isneginf(out).sum())
            seen["nan"] = int(torch.isnan(out).sum())

    h = model.get_submodule(conv_name).register_forward_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = record_loop(model, run_dir, batch, 130, opt, after_step=lambda s, l: cur.__setitem__(0, s + 1))
    h.remove()
    assert seen.get("step") == bad_step, seen
    assert all(map(math.isfinite, losses[:bad_step])) and not math.isfinite(losses[bad_step]), losses[bad_step - 2:]
    return Oracle("nonfinite", step=seen["step"], where=[conv_name], step_tolerance=0,
                  evidence={**seen, "nodata_value": nodata, "loss_at_bad_step": losses[bad_step]})


class GeM(nn.Module):
    """Generalized-mean pooling (Radenovic et al. 2018) with a learnable p, written WITHOUT the
    reference implementation's x.clamp(min=eps): a channel whose ReLU map is all zero pools to 0,
    and the gradient of 0 ** (1/p) is not finite."""

    def __init__(self, p: float = 3.0):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))

    def forward(self, x):
        return x.pow(self.p).mean((-2, -1), keepdim=True).pow(1.0 / self.p)


@scenario("resnet_gem_pool_nan_grad", "resnet", "nonfinite", "init",
          "generalized-mean (GeM) pooling with learnable p without the eps clamp of the reference code "
          "(Radenovic, Tolias & Chum 2018, cirtorch: x.clamp(min=eps).pow(p)): the pow's backward at a "
          "pooled 0 gives NaN")
def resnet_gem_pool_nan_grad(run_dir: str) -> Oracle:
    g = seed_all(13)
    model = _resnet()
    model.resnet.pooler = GeM()
    seen, fwd_ok = {}, {}
    cur = [0]

    def fwd_hook(module, args, out):  # the forward of the GeM stays finite at the step the NaN is born
        if torch.is_grad_enabled():
            fwd_ok[cur[0]] = bool(torch.isfinite(out).all()) and bool(torch.isfinite(args[0]).all())

    h = model.resnet.pooler.register_forward_hook(fwd_hook)

    # The oracle: the first step at which a parameter's gradient (p.grad) holds NaN/Inf while the
    # forward (GeM's input and output, the loss) was finite; `where` = the parameter(s) whose
    # gradient went non-finite (that step), i.e. GeM's exponent p in resnet.pooler.
    def before_update(step):
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        if bad and "step" not in seen:
            seen.update(step=step, params=bad, forward_finite=fwd_ok.get(step))
        cur[0] = step + 1

    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = record_loop(model, run_dir, _images(g), 60, opt, before_update=before_update)
    h.remove()
    assert seen.get("step") is not None and seen["forward_finite"] and math.isfinite(losses[seen["step"]]), seen
    assert seen["params"] == ["resnet.pooler.p"], seen
    return Oracle("nonfinite", step=seen["step"], where=["resnet.pooler", "resnet.pooler.p"], step_tolerance=0,
                  evidence={**seen, "loss_at_step": losses[seen["step"]],
                            "first_nonfinite_loss_step": next((i for i, v in enumerate(losses)
                                                               if not math.isfinite(v)), None)})
