"""CNN scenarios (family "cnn"): small hand-written conv nets, with and without BatchNorm, on
synthetic 16x16 images (oriented sinusoidal gratings: the class is the orientation), each a short
real training run whose pathology (or health) the scenario proves from its own measurements."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Activity, Oracle, first_step, grad_norms, record_loop, scenario, seed_all


# -- synthetic data ------------------------------------------------------------------------------

def _gratings(g: torch.Generator, batch: int = 32, size: int = 16, n_cls: int = 4, noise: float = 0.3):
    """Sinusoidal gratings with a random frequency and phase, plus noise; the label is one of
    n_cls orientations (0, 45, 90, 135 degrees for 4). Values about in [-1.5, 1.5]."""
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")

    def make(step: int):
        y = torch.randint(n_cls, (batch,), generator=g)
        theta = y.float() * math.pi / n_cls
        freq = 2 * math.pi * (0.12 + 0.1 * torch.rand(batch, generator=g))
        phase = 2 * math.pi * torch.rand(batch, generator=g)
        proj = xx[None] * torch.cos(theta)[:, None, None] + yy[None] * torch.sin(theta)[:, None, None]
        img = torch.sin(freq[:, None, None] * proj + phase[:, None, None])
        img = img + noise * torch.randn(batch, size, size, generator=g)
        return img[:, None], y

    return make


def _conv_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def _total(norms: dict) -> float:
    return math.sqrt(sum(v * v for v in norms.values()))


def _small_cnn(act=nn.ReLU, bn: bool = False, width: int = 16) -> nn.Sequential:
    """conv-act-conv-act-pool-conv-act-GAP-linear (with BatchNorm after each conv if bn)."""
    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not bn)] + ([nn.BatchNorm2d(c_out)] if bn else []) + [act()]

    return nn.Sequential(*block(1, width), *block(width, 2 * width), nn.MaxPool2d(2), *block(2 * width, 2 * width),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 4))


# -- exploding gradients -------------------------------------------------------------------------

@scenario("cnn_large_gain_init_exploding", "cnn", "exploding_gradients", "init",
          "He et al. 2015 'Delving deep into rectifiers' sec. 2.2: with std above sqrt(2/fan_in) a deep "
          "ReLU conv stack multiplies signals and gradients by a constant > 1 per layer (their fixed "
          "std 0.01 / 'too large' discussion); Glorot & Bengio 2010")
def cnn_large_gain_init_exploding(run_dir: str) -> Oracle:
    g = seed_all(20)
    depth, ch, std = 9, 16, 0.35  # He's std for fan_in 144 is 0.118: a gain of ~3 per layer

    def build():
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Conv2d(1 if i == 0 else ch, ch, 3, padding=1), nn.ReLU()]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, 4))

    model = build()
    for m in model:
        if isinstance(m, nn.Conv2d):
            nn.init.normal_(m.weight, 0.0, std)  # the bug: a fixed std chosen for a small layer
            nn.init.zeros_(m.bias)
    # The reference: the same architecture with He init, on the same first batch.
    ref = build()
    for m in ref:
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    data = _gratings(g)
    x0, y0 = data(0)
    F.cross_entropy(ref(x0), y0).backward()
    ref_norms = grad_norms(ref)
    first = {"done": False}

    def batch(step):
        if not first["done"]:
            first["done"] = True
            return x0, y0
        return data(step)

    norms: list[dict] = []
    # Adam (its step size does not grow with the gradient) keeps the run finite; plain SGD would
    # overflow to NaN within 4 steps.
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 40, opt, F.cross_entropy,
                         before_update=lambda s: norms.append(grad_norms(model)))
    assert all(map(math.isfinite, losses)), losses
    # Definition: exploding = the total gradient norm exceeds 1e3 x that of the He-initialised
    # reference on the same batch. The step is the first such step.
    ratio = [_total(n) / _total(ref_norms) for n in norms]
    step = first_step(ratio, lambda r: not r <= 1e3)
    assert step == 0, ratio[:3]
    # At fault: every conv layer whose weight gradient is > 100x its He counterpart's.
    where = [c for c in _conv_names(model) if norms[0][f"{c}.weight"] > 100 * ref_norms[f"{c}.weight"]]
    assert where
    return Oracle("exploding_gradients", step=step, where=where, step_tolerance=1,
                  evidence={"grad_norm_step0": _total(norms[0]), "grad_norm_he_reference": _total(ref_norms),
                            "ratio_step0": ratio[0], "loss_step0": losses[0], "loss_last": losses[-1]})


@scenario("cnn_raw_sensor_units_exploding", "cnn", "exploding_gradients", "mid",
          "LeCun et al. 1998 'Efficient BackProp' sec. 4.3 (inputs must be normalised; the gradient "
          "of a layer scales with its input); a data-pipeline change that sends raw sensor counts "
          "(offset and x1000) from some step on")
def cnn_raw_sensor_units_exploding(run_dir: str) -> Oracle:
    g = seed_all(21)
    model = _small_cnn()
    data = _gratings(g)
    shift = 150

    def batch(step):
        x, y = data(step)
        # the calibration step was dropped: raw ADC counts (offset 2000, 1000 counts a unit)
        return (1000.0 * (x + 2.0) if step >= shift else x), y

    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = record_loop(model, run_dir, batch, shift + 6, opt, F.cross_entropy,
                         before_update=lambda s: norms.append(grad_norms(model)))
    total = [_total(n) for n in norms]
    base = max(total[shift - 50:shift])
    # Definition: the first step (from 50 steps before the shift on) whose total gradient norm
    # exceeds 100x the largest of the 50 steps before the shift.
    step = first_step(range(len(total)), lambda i: i >= shift - 50 and not total[i] <= 100 * base)
    assert step is not None and step >= shift and all(map(math.isfinite, total[:step + 1])), total[shift - 2:]
    # At fault: every parameter whose own gradient norm there exceeds 100x its own largest in the
    # 50 steps before the shift.
    where = [n for n in norms[0] if not norms[step][n] <= 100 * max(x[n] for x in norms[shift - 50:shift])]
    return Oracle("exploding_gradients", step=step, where=where, step_tolerance=1,
                  evidence={"max_grad_norm_50_before": base, "grad_norm_at_step": total[step],
                            "grad_norm_last": total[-1],
                            "loss_before": losses[shift - 1], "loss_at_step": losses[step], "shift_step": shift})


# -- vanishing gradients -------------------------------------------------------------------------

@scenario("cnn_deep_sigmoid_vanishing", "cnn", "vanishing_gradients", "init",
          "Glorot & Bengio 2010; Hochreiter 1991: sigmoid'(x) <= 1/4, so a deep sigmoid conv stack "
          "(LeNet-style activations, no normalisation) shrinks the gradient geometrically towards the input")
def cnn_deep_sigmoid_vanishing(run_dir: str) -> Oracle:
    g = seed_all(22)
    depth, ch = 7, 8
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Conv2d(1 if i == 0 else ch, ch, 3, padding=1), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch, 4))  # default init
    convs = _conv_names(model)
    out = "16"
    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = record_loop(model, run_dir, _gratings(g), 120, opt, F.cross_entropy,
                         before_update=lambda s: norms.append(grad_norms(model)))
    # Definition: vanishing = the first conv's weight-gradient norm below 1e-4 x the output
    # layer's; the step is the first such step, and it must hold on every step of the run.
    ratios = [n[f"{convs[0]}.weight"] / n[f"{out}.weight"] for n in norms]
    step = first_step(ratios, lambda r: r < 1e-4)
    assert step == 0 and max(ratios) < 1e-4, (ratios[:3], max(ratios))
    ref = norms[step][f"{out}.weight"]
    where = [c for c in convs if norms[step][f"{c}.weight"] < 1e-3 * ref]
    return Oracle("vanishing_gradients", step=step, where=where, step_tolerance=1,
                  evidence={"first_over_output_grad_ratio_step0": ratios[0], "max_ratio": max(ratios),
                            "loss_first": losses[0], "loss_last": losses[-1]})


# -- non-finite values ---------------------------------------------------------------------------

class InstanceNormNoEps(nn.Module):
    """A hand-written instance normalisation with an affine weight and bias, but no eps in the
    denominator (Ulyanov et al. 2016 define it with one, for exactly this reason)."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        mean = x.mean(dim=(2, 3), keepdim=True)
        std = x.var(dim=(2, 3), keepdim=True, unbiased=False).sqrt()
        return (x - mean) / std * self.weight[:, None, None] + self.bias[:, None, None]


@scenario("cnn_instancenorm_no_eps_blank_frame", "cnn", "nonfinite", "mid",
          "Ulyanov, Vedaldi & Lempitsky 2016 'Instance Normalization' (the eps in the denominator); "
          "a blank (all-zero) frame from a corrupt record gives every channel a constant map, "
          "variance 0, and 0/0 = NaN in a normalisation layer without eps")
def cnn_instancenorm_no_eps_blank_frame(run_dir: str) -> Oracle:
    g = seed_all(23)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), InstanceNormNoEps(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 4))
    data = _gratings(g)
    bad = 90

    def batch(step):
        x, y = data(step)
        if step == bad:
            x = x.clone()
            x[3] = 0.0  # a blank frame
        return x, y

    # The oracle: our own forward hooks on every module: the first (step, module) whose output
    # holds a NaN/Inf while its inputs are finite.
    state = {"step": 0}
    born: list[tuple[int, str, str]] = []

    def hook(name):
        def fn(module, args, out):
            if not torch.is_grad_enabled() or born:
                return
            if all(torch.isfinite(a).all() for a in args if torch.is_tensor(a)) and not torch.isfinite(out).all():
                kind = "nan" if torch.isnan(out).any() else "inf"
                born.append((state["step"], name, kind))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = record_loop(model, run_dir, batch, 110, opt, F.cross_entropy,
                         after_step=lambda s, l: state.__setitem__("step", s + 1))
    for h in handles:
        h.remove()
    assert born and born[0][0] == bad and born[0][1] == "1", born
    assert all(map(math.isfinite, losses[:bad])) and not math.isfinite(losses[bad])
    return Oracle("nonfinite", step=bad, where=["1"], step_tolerance=0,
                  evidence={"born": list(born[0]), "loss_before": losses[bad - 1]})


# -- dead ReLUs ----------------------------------------------------------------------------------

@scenario("cnn_dead_relu_after_lr_jump", "cnn", "dead_relu", "mid",
          "CS231n notes (Karpathy), 'dying ReLU': 'with a proper setting of the learning rate this is "
          "less frequently an issue' — a too-large update knocks units into a region where they never "
          "fire again; here Adam's lr jumps 200x (a schedule bug)")
def cnn_dead_relu_after_lr_jump(run_dir: str) -> Oracle:
    g = seed_all(24)
    model = _small_cnn()  # relus at 1, 3 and 6
    act = Activity({"1": model[1], "3": model[3], "6": model[6]})
    window, jump = 10, 150

    def before_update(step):
        if step == jump - 1:
            for group in opt.param_groups:
                group["lr"] = 0.2

    def after_step(step, loss):
        if (step + 1) % window == 0:
            act.end_window()

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, _gratings(g), 300, opt, F.cross_entropy, before_update=before_update,
                         after_step=after_step)
    act.remove()
    # Definition: a unit (channel) is dead in a window of 10 steps when it was never positive at
    # any position of any image of it; a layer dies at the first step of the first window from
    # which >= 50% of its units are dead in every later window.
    died = {}
    for name, hist in act.history.items():
        w = first_step(range(len(hist)), lambda i: min(hist[i:]) >= 0.5)
        if w is not None:
            died[name] = w * window
    assert died and min(died.values()) >= jump, (died, act.history)
    assert all(max(h[:jump // window]) < 0.1 for h in act.history.values()), act.history  # alive before
    step = min(died.values())
    where = sorted(died) + [str(int(n) - 1) for n in sorted(died)]  # the ReLUs and the convs feeding them
    return Oracle("dead_relu", step=step, where=where, step_tolerance=50,
                  evidence={"dead_share_per_window": {n: [round(v, 2) for v in h] for n, h in act.history.items()},
                            "died_at": died, "loss_before_jump": losses[jump - 1], "loss_last": losses[-1]})


# -- healthy controls ----------------------------------------------------------------------------

def _health(losses, norms, act) -> dict:
    """The oracle of health: loss falls clearly, everything finite, gradients within 100x of
    their start both ways, few channels never active in a 50-step window."""
    total = [_total(n) for n in norms]
    dead = max(max(h) for h in act.history.values())
    assert all(map(math.isfinite, losses + total))
    assert sum(losses[-20:]) < 0.3 * sum(losses[:20]), losses[::25]
    assert max(total) < 100 * total[0] and min(total) > 1e-3 * total[0], (max(total), min(total), total[0])
    assert dead < 0.2, act.history
    return {"loss_first": losses[0], "loss_last": losses[-1], "grad_norm_max": max(total),
            "grad_norm_min": min(total), "max_dead_share": dead}


@scenario("cnn_healthy_bn_adamw_cosine", "cnn", None, "healthy",
          "the usual recipe: BatchNorm (Ioffe & Szegedy 2015), AdamW with linear warm-up and cosine "
          "decay (Loshchilov & Hutter 2017, 2019)")
def cnn_healthy_bn_adamw_cosine(run_dir: str) -> Oracle:
    g = seed_all(25)
    model = _small_cnn(bn=True)  # relus at 2, 5, 9
    act = Activity({"2": model[2], "5": model[5], "9": model[9]})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    steps, warm = 250, 25
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    norms: list[dict] = []
    losses = record_loop(model, run_dir, _gratings(g), steps, opt, F.cross_entropy, scheduler=sched,
                         before_update=lambda s: norms.append(grad_norms(model)),
                         after_step=lambda s, l: act.end_window() if (s + 1) % 50 == 0 else None)
    act.remove()
    return Oracle(None, evidence=_health(losses, norms, act))


class _AutocastNet(nn.Module):
    """A small CNN whose forward runs under CPU bf16 autocast (the AMP docs' 'autocast in the
    model's forward' pattern); logits returned in float32 for the loss."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(self.features(x)).float()


@scenario("cnn_healthy_bf16_autocast", "cnn", None, "healthy",
          "mixed precision with bf16 autocast (PyTorch AMP docs, torch.autocast('cpu', "
          "dtype=torch.bfloat16); Kalamkar et al. 2019 'A study of BFLOAT16 for deep learning training')")
def cnn_healthy_bf16_autocast(run_dir: str) -> Oracle:
    g = seed_all(26)
    model = _AutocastNet()
    act = Activity({"features.2": model.features[2], "features.5": model.features[5],
                    "features.8": model.features[8]})
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    norms: list[dict] = []
    losses = record_loop(model, run_dir, _gratings(g), 200, opt, F.cross_entropy, clip=5.0,
                         before_update=lambda s: norms.append(grad_norms(model)),
                         after_step=lambda s, l: act.end_window() if (s + 1) % 50 == 0 else None)
    act.remove()
    return Oracle(None, evidence=_health(losses, norms, act))
