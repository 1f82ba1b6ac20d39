"""Autoencoder scenarios: small hand-written convolutional autoencoders (a plain encoder-decoder,
a U-Net with a skip connection, a deep sigmoid stack) reconstructing synthetic images (smooth
random colour fields; binary discs for the BCE case), all generated here from a seed."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from .base import LOSS, Oracle, grad_norms, record_loop, rss_mib, scenario, seed_all

RELUS = ["act1", "act2", "act3", "act4", "act5"]
CONV_BEFORE = {"act1": "enc1", "act2": "enc2", "act3": "enc3", "act4": "dec1", "act5": "dec2"}


def _fields(g: torch.Generator, n: int = 32):
    """Smooth random colour fields, 3x16x16 (std ~0.6); the target is the input."""

    def batch(step: int):
        x = F.avg_pool2d(torch.randn(n, 3, 20, 20, generator=g), 5, 1) * 3.0
        return x, x

    return batch


def _discs(g: torch.Generator, n: int = 32):
    """Binary 1x16x16 images: the union of two random discs (pixels exactly 0 or 1)."""
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")

    def batch(step: int):
        c = torch.rand(n, 2, 2, generator=g) * 16
        r = 1.5 + torch.rand(n, 2, generator=g) * 3
        d = ((yy - c[..., 0, None, None]) ** 2 + (xx - c[..., 1, None, None]) ** 2).sqrt()
        x = (d < r[..., None, None]).any(1, keepdim=True).float()
        return x, x

    return batch


def _plain_ae(c: int = 3, init: str = "he") -> nn.Sequential:
    """16x16 -> 8x8 -> 4x4 -> 8x8 -> 16x16, ReLUs, no normalisation, no skip."""
    model = nn.Sequential(OrderedDict([
        ("enc1", nn.Conv2d(c, 16, 3, 1, 1)), ("act1", nn.ReLU()),
        ("enc2", nn.Conv2d(16, 32, 3, 2, 1)), ("act2", nn.ReLU()),
        ("enc3", nn.Conv2d(32, 32, 3, 2, 1)), ("act3", nn.ReLU()),
        ("dec1", nn.ConvTranspose2d(32, 32, 4, 2, 1)), ("act4", nn.ReLU()),
        ("dec2", nn.ConvTranspose2d(32, 16, 4, 2, 1)), ("act5", nn.ReLU()),
        ("out", nn.Conv2d(16, c, 3, 1, 1)),
    ]))
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            if init == "he":  # He et al. 2015 (a transposed conv's fan-in is its weight's dim 0)
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu",
                                        mode="fan_out" if isinstance(m, nn.ConvTranspose2d) else "fan_in")
                nn.init.zeros_(m.bias)
            elif init == "normal":  # the bug: nn.init.normal_ with its default std=1
                nn.init.normal_(m.weight)
    return model


class AliveSteps:
    """Per step, which channels of each watched ReLU were ever positive (our forward hooks); then,
    per step s, the share of channels never positive at any step >= s ("dead for good from s")."""

    def __init__(self, model, names):
        self.steps: list[dict[str, torch.Tensor]] = []
        self.cur: dict[str, torch.Tensor] = {}
        self._h = [model.get_submodule(n).register_forward_hook(self._hook(n)) for n in names]
        self.names = names

    def _hook(self, name):
        def hook(module, args, out):
            if torch.is_grad_enabled():
                self.cur[name] = (out.detach() > 0).flatten(2).any(-1).any(0)
        return hook

    def end_step(self):
        self.steps.append(dict(self.cur))
        self.cur.clear()

    def dead_for_good(self) -> dict[str, list[float]]:
        res = {}
        for n in self.names:
            ever = torch.zeros_like(self.steps[-1][n])
            share = []
            for s in reversed(self.steps):
                ever |= s[n]
                share.append(1.0 - float(ever.float().mean()))
            res[n] = share[::-1]
        return res

    def remove(self):
        for h in self._h:
            h.remove()


# -- healthy control ------------------------------------------------------------------------------

class UNet(nn.Module):
    """A small U-Net (Ronneberger et al. 2015): conv-BN-ReLU blocks, one down/up level, the
    encoder's full-resolution features concatenated into the decoder; forward in bf16 autocast."""

    def __init__(self, c: int = 3, width: int = 16):
        super().__init__()

        def block(i, o, stride=1):
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

        self.enc = block(c, width)
        self.down = block(width, 2 * width, 2)
        self.mid = block(2 * width, 2 * width)
        self.up = nn.Sequential(nn.ConvTranspose2d(2 * width, width, 4, 2, 1, bias=False), nn.BatchNorm2d(width),
                                nn.ReLU())
        self.dec = block(2 * width, width)
        self.out = nn.Conv2d(width, c, 1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            e = self.enc(x)
            u = self.up(self.mid(self.down(e)))
            return self.out(self.dec(torch.cat([u, e], 1)))


@scenario("autoencoder_healthy_unet_bf16", "autoencoder", None, "healthy",
          "the usual recipe: a U-Net with skip connections and BatchNorm (Ronneberger et al. 2015; Ioffe & "
          "Szegedy 2015), bf16 autocast on CPU (PyTorch AMP docs), AdamW with warm-up and cosine decay")
def autoencoder_healthy_unet_bf16(run_dir: str) -> Oracle:
    g = seed_all(30)
    model = UNet()
    steps, warm = 200, 15
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    relus = [n for n, m in model.named_modules() if isinstance(m, nn.ReLU)]
    alive = AliveSteps(model, relus)
    gn = []

    def before_update(step):
        gn.append(math.sqrt(sum(v * v for v in grad_norms(model).values())))

    losses = record_loop(model, run_dir, _fields(g), steps, opt, lambda out, y: F.mse_loss(out.float(), y),
                         scheduler=sched, before_update=before_update, after_step=lambda s, l: alive.end_step())
    alive.remove()
    dead = {n: max(v) for n, v in alive.dead_for_good().items()}
    # The oracle of health: the reconstruction loss falls clearly (to < 30% of its start), all
    # finite, gradient norms never grow past the first 20 steps' largest (they shrink as the loss
    # falls), no ReLU has a majority of channels dead for good.
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.3 * sum(losses[:20]), losses[::20]
    assert all(map(math.isfinite, gn)) and max(gn[20:]) < max(gn[:20]), gn[::20]
    assert max(dead.values()) < 0.5, dead
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "grad_norm_max_first20": max(gn[:20]), "grad_norm_max_after": max(gn[20:]),
                                  "max_dead_for_good_share": max(dead.values())})


# -- exploding / vanishing ----------------------------------------------------------------------

@scenario("autoencoder_normal_init_explodes", "autoencoder", "exploding_gradients", "init",
          "exploding activations and gradients from a too-large init: weights drawn N(0, 1) (nn.init.normal_'s "
          "default std) instead of He's N(0, 2/fan_in) (He et al. 2015; Glorot & Bengio 2010)")
def autoencoder_normal_init_explodes(run_dir: str) -> Oracle:
    g = seed_all(31)
    model = _plain_ae(init="normal")
    batch = _fields(g)
    x0, y0 = batch(0)
    first = [(x0, y0)]

    def data(step):
        return first.pop() if step == 0 and first else batch(step)

    # The reference: the same architecture with He init, on the same first batch.
    torch.manual_seed(31)
    ref = _plain_ae(init="he")
    F.mse_loss(ref(x0), y0).backward()
    ref_norms = grad_norms(ref)
    ref_total = math.sqrt(sum(v * v for v in ref_norms.values()))
    torch.manual_seed(131)
    gn, per0 = [], {}

    def before_update(step):
        norms = grad_norms(model)
        if step == 0:
            per0.update(norms)
        gn.append(math.sqrt(sum(v * v for v in norms.values())))

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, data, 100, opt, F.mse_loss, before_update=before_update)
    # The oracle: at step 0 the global gradient norm (p.grad) is > 1e3 x the He-initialised
    # network's on the same batch; step = 0, the first step it holds; where = the weights whose own
    # gradient norm is > 1e3 x their He counterpart's at step 0.
    ratio = gn[0] / ref_total
    where = [n for n in per0 if n.endswith("weight") and per0[n] > 1e3 * ref_norms[n]]
    assert ratio > 1e3 and where, (ratio, per0, ref_norms)
    assert all(map(math.isfinite, losses))
    return Oracle("exploding_gradients", step=0, where=where, step_tolerance=2,
                  evidence={"grad_norm_step0": gn[0], "he_init_grad_norm_step0": ref_total, "ratio": ratio,
                            "per_weight_ratio": {n: per0[n] / ref_norms[n] for n in per0 if n.endswith("weight")},
                            "grad_norm_every_10": gn[::10], "loss_first": losses[0], "loss_last": losses[-1]})


@scenario("autoencoder_deep_sigmoid_vanishing", "autoencoder", "vanishing_gradients", "init",
          "vanishing gradients in a deep sigmoid network: each sigmoid's derivative is <= 1/4, so the "
          "gradient shrinks geometrically toward the input (Hochreiter 1991; Glorot & Bengio 2010)")
def autoencoder_deep_sigmoid_vanishing(run_dir: str) -> Oracle:
    g = seed_all(32)
    layers, c = [], 3
    for i in range(1, 7):  # six conv+sigmoid layers, no skip, PyTorch's default init
        layers += [(f"conv{i}", nn.Conv2d(c, 16, 3, 1, 1)), (f"sig{i}", nn.Sigmoid())]
        c = 16
    layers.append(("out", nn.Conv2d(16, 3, 3, 1, 1)))
    model = nn.Sequential(OrderedDict(layers))
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    ratios, per = [], []

    # The oracle: per step, ||grad conv1.weight|| / ||grad out.weight|| (from p.grad); it is
    # < 1e-3 at step 0 (the first step it holds) and at every step of the run.
    def before_update(step):
        norms = grad_norms(model)
        ratios.append(norms["conv1.weight"] / norms["out.weight"])
        if step == 0:
            per.append({n: norms[n + ".weight"] for n in convs})

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = record_loop(model, run_dir, _fields(g), 150, opt, F.mse_loss, before_update=before_update)
    last = per[0]["out"]
    # where = the conv layers whose weight-gradient norm at step 0 is < 1e-3 x the output layer's.
    where = [n for n in convs if per[0][n] < 1e-3 * last]
    assert all(r < 1e-3 for r in ratios), max(ratios)
    assert "conv1" in where and all(map(math.isfinite, losses))
    return Oracle("vanishing_gradients", step=0, where=where, step_tolerance=2,
                  evidence={"grad_norm_per_conv_step0": per[0], "first_over_last_step0": ratios[0],
                            "first_over_last_max": max(ratios), "loss_first": losses[0], "loss_last": losses[-1]})


# -- nonfinite ------------------------------------------------------------------------------------

@scenario("autoencoder_bce_saturated_nan", "autoencoder", "nonfinite", "mid",
          "a hand-written binary cross-entropy on sigmoid outputs: once a sigmoid saturates to exactly "
          "1.0 in float32, (1 - y) * log(1 - p) = 0 * -inf = NaN (why nn.BCELoss clamps its log at -100 "
          "and BCEWithLogitsLoss exists; PyTorch docs)")
def autoencoder_bce_saturated_nan(run_dir: str) -> Oracle:
    g = seed_all(33)
    model = _plain_ae(c=1, init="he")
    model.add_module("sig", nn.Sigmoid())
    out_ok, cur = {}, [0]

    def hook(module, args, out):
        if torch.is_grad_enabled():
            out_ok[cur[0]] = (bool(torch.isfinite(out).all()), float((out == 1.0).sum()), float((out == 0.0).sum()))

    h = model.sig.register_forward_hook(hook)

    def bce(p, y):
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, _discs(g), 120, opt, bce, after_step=lambda s, l: cur.__setitem__(0, s + 1))
    h.remove()
    # The oracle: the first step whose loss is NaN while the model's output (the sigmoid's, our
    # hook) is all finite: the NaN is born in the loss function (0 * log(0)); its backward hands
    # NaN to the sigmoid and everything upstream. where = the output sigmoid and the conv feeding it.
    step = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    finite_out, n_one, n_zero = out_ok[step]
    assert finite_out and (n_one > 0 or n_zero > 0), out_ok[step]
    assert step > 10
    return Oracle("nonfinite", step=step, where=[LOSS], step_tolerance=0,
                  evidence={"loss_before": losses[step - 1], "pixels_exactly_1": n_one, "pixels_exactly_0": n_zero,
                            "loss_first": losses[0]})


# -- dead ReLUs ------------------------------------------------------------------------------------

@scenario("autoencoder_lr_spike_dying_relu", "autoencoder", "dead_relu", "mid",
          "dying ReLUs after a learning-rate spike: a large update knocks units into the region where they "
          "never fire again (CS231n notes, 'Commonly used activation functions'; Lu et al. 2019)")
def autoencoder_lr_spike_dying_relu(run_dir: str) -> Oracle:
    g = seed_all(34)
    model = _plain_ae(init="he")
    alive = AliveSteps(model, RELUS)
    spike, n_spike, base_lr = 100, 3, 1e-3
    opt = torch.optim.Adam(model.parameters(), lr=base_lr)

    def before_update(step):
        for group in opt.param_groups:  # lr x100 for three steps (a schedule bug), then back
            group["lr"] = base_lr * 100 if spike <= step < spike + n_spike else base_lr

    losses = record_loop(model, run_dir, _fields(g), 250, opt, F.mse_loss, before_update=before_update,
                         after_step=lambda s, l: alive.end_step())
    alive.remove()
    dead = alive.dead_for_good()
    # The oracle: a ReLU's channel is dead for good from step s if it is never positive (on any
    # sample or position of the training batches, our hooks) at any step >= s. step = the first
    # step at which some ReLU has >= 50% of its channels dead for good; where = the ReLUs (and the
    # convs feeding them) with >= 50% dead for good at the end.
    step = next(s for s in range(len(losses)) if max(dead[n][s] for n in RELUS) >= 0.5)
    where_relu = [n for n in RELUS if dead[n][-1] >= 0.5]
    before = max(max(dead[n][:spike]) for n in RELUS)
    assert before == 0.0 and spike <= step <= spike + n_spike + 2, (before, step)
    assert all(map(math.isfinite, losses))
    return Oracle("dead_relu", step=step, where=where_relu + [CONV_BEFORE[n] for n in where_relu], step_tolerance=50,
                  evidence={"dead_for_good_share_at_step": {n: dead[n][step] for n in RELUS},
                            "dead_for_good_share_at_end": {n: dead[n][-1] for n in RELUS},
                            "max_dead_share_before_spike": before,
                            "loss_before_spike": sum(losses[spike - 10:spike]) / 10,
                            "loss_last10": sum(losses[-10:]) / 10})


# -- memory leak -----------------------------------------------------------------------------------

@scenario("autoencoder_feature_cache_leak", "autoencoder", "memory_leak", "mid",
          "a forward hook that keeps every feature map it sees (for visualisation) and is never cleared: "
          "memory grows each step (PyTorch FAQ, 'My model reports out of memory': don't accumulate history "
          "across the training loop)")
def autoencoder_feature_cache_leak(run_dir: str) -> Oracle:
    g = seed_all(35)
    model = _plain_ae(init="he")
    leak_from, steps = 60, 300
    cache: list[torch.Tensor] = []
    handle = []
    rss = []

    def before_update(step):
        if step + 1 == leak_from:  # from step 60 on, every forward's act1 output is kept (1 MiB each)
            handle.append(model.act1.register_forward_hook(lambda m, a, out: cache.append(out)))

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, _fields(g, n=64), steps, opt, F.mse_loss, before_update=before_update,
                         after_step=lambda s, l: rss.append(rss_mib()))
    for h in handle:
        h.remove()
    # The oracle: resident memory (our /proc reading) is ~flat before step 60 and grows steadily
    # after it by about the size of the kept tensors; step = 60, the first step whose output is kept.
    kept_mib = sum(t.numel() * t.element_size() for t in cache) / 2**20
    slope_before = (rss[leak_from - 1] - rss[20]) / (leak_from - 1 - 20)
    slope_after = (rss[-1] - rss[leak_from]) / (steps - 1 - leak_from)
    per_step = kept_mib / len(cache)
    # (flat: the growth per step before is < 1/5 of the growth after; the small growth before is
    # the process's own: allocator, recorder buffers)
    assert len(cache) == steps - leak_from and slope_after > 0.5 * per_step and slope_before < 0.2 * slope_after, \
        (slope_before, slope_after, per_step)
    assert rss[-1] - rss[leak_from] > 100
    del cache
    return Oracle("memory_leak", step=leak_from, where=["act1"], step_tolerance=50,
                  evidence={"kept_mib": kept_mib, "rss_growth_mib_per_step_before": slope_before,
                            "rss_growth_mib_per_step_after": slope_after,
                            "rss_at_leak_start": rss[leak_from], "rss_at_end": rss[-1],
                            "loss_first": losses[0], "loss_last": losses[-1]})
