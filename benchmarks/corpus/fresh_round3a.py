"""Fresh scenarios, round 3, part a (split "fresh": written without reading the detectors or their
thresholds, held out from all tuning): dead units in one call of a module called several times,
and a NaN/-Inf born in a weightless submodule (part b: exploding gradients and slow memory leaks;
part c: healthy controls). Each is a short real training run recorded by the default Recorder;
the oracle is the scenario's own measurement (its own forward hooks, p.grad, the loss), asserted,
so that a run that does not show its pathology fails instead of being mislabelled."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, grad_norms, hf, image_templates, record_loop, scenario, seed_all


def _total(norms: dict[str, float]) -> float:
    return math.sqrt(sum(v * v for v in norms.values()))


# -- dead units in one call of a module called more than once ----------------------------------------

class _PerCall:
    """The dead-unit oracle per call: which channels of `module`'s output were ever positive, for
    each call of it (call k: the k-th since `parent`'s forward began), over windows of steps."""

    def __init__(self, module: nn.Module, parent: nn.Module):
        self.k, self.seen, self.history = 0, {}, {}
        self._h = [parent.register_forward_pre_hook(lambda m, a: setattr(self, "k", 0)),
                   module.register_forward_hook(self._hook)]

    def _hook(self, module, args, out):
        if module.training and torch.is_grad_enabled():
            alive = (out.detach() > 0).flatten(2).any(-1).any(0)
            self.seen[self.k] = alive | self.seen[self.k] if self.k in self.seen else alive
        self.k += 1

    def end_window(self):
        for k, alive in self.seen.items():
            self.history.setdefault(k, []).append(1.0 - float(alive.float().mean()))
        self.seen = {}

    def remove(self):
        for h in self._h:
            h.remove()


class _BasicBlock(nn.Module):
    """A residual block written the way torchvision writes BasicBlock: ONE nn.ReLU module, called
    after bn1 and again after the residual sum."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


@scenario("fresh3_resnet_basicblock_shared_relu_first_call_dead", "resnet", "dead_relu", "init",
          "a BasicBlock-style residual block (He et al. 2016; torchvision's BasicBlock calls its one nn.ReLU "
          "twice) whose bn1 beta starts at -10: every channel of the first call is negative before the ReLU "
          "and never fires again, no gradient reaching bn1 (Lu et al. 2019, 'Dying ReLU and Initialization'), "
          "while the second call, after the residual sum, stays alive", fresh=True)
def fresh3_resnet_basicblock_shared_relu_first_call_dead(run_dir: str) -> Oracle:
    g = seed_all(600)
    model = nn.Sequential()
    model.add_module("stem", nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()))
    model.add_module("layer1", nn.Sequential(_BasicBlock(16, 16), _BasicBlock(16, 16)))
    model.add_module("layer2", nn.Sequential(_BasicBlock(16, 32, 2), _BasicBlock(32, 32)))
    model.add_module("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()))
    model.add_module("fc", nn.Linear(32, 8))
    block = model.layer1[1]
    with torch.no_grad():
        block.bn1.bias.fill_(-10.0)  # the bug
    per_call = _PerCall(block.relu, block)
    sample = image_templates(g, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def after_step(step, loss):
        if (step + 1) % 25 == 0:
            per_call.end_window()

    losses = record_loop(model, run_dir, lambda s: sample(32, 2.0), 150, opt, F.cross_entropy,
                         after_step=after_step)
    per_call.remove()
    # The oracle: our hook's share of channels never positive over each 25-step window, per call of
    # layer1.1.relu: call 0 (after bn1) 100 % dead in every window from the first; call 1 (after the
    # residual sum) mostly alive; the net learns through the identity path.
    h = per_call.history
    assert sorted(h) == [0, 1] and min(h[0]) == 1.0 and max(h[1]) < 0.25, h
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.7 * sum(losses[:20]), losses[::10]
    return Oracle("dead_relu", step=0, where=["layer1.1.relu"], step_tolerance=50,
                  evidence={"dead_share_call0_per_25_steps": h[0], "dead_share_call1_per_25_steps": h[1],
                            "bn1_beta": -10.0, "loss_first20": sum(losses[:20]) / 20,
                            "loss_last20": sum(losses[-20:]) / 20})


@scenario("fresh3_cnn_looped_shared_block_one_iteration_dead", "cnn", "dead_relu", "init",
          "a weight-tied ('looped') residual block unrolled 4 times, one BatchNorm per iteration (Liao & Poggio "
          "2016, 'Bridging the gaps between residual learning, recurrent neural networks and visual cortex'; "
          "ALBERT-style sharing, Lan et al. 2020): iteration 2's BN beta starts at -8, so that iteration's "
          "units never fire (Lu et al. 2019) while the same ReLU module's other three calls live", fresh=True)
def fresh3_cnn_looped_shared_block_one_iteration_dead(run_dir: str) -> Oracle:
    g = seed_all(601)
    iters, bad, ch = 4, 2, 24

    class Looped(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, 2, 1, bias=False), nn.BatchNorm2d(ch))
            self.conv = nn.Conv2d(ch, ch, 3, 1, 1, bias=False)  # shared by every iteration
            self.relu = nn.ReLU()  # shared by every iteration
            self.bns = nn.ModuleList(nn.BatchNorm2d(ch) for _ in range(iters))  # one per iteration
            self.head = nn.Linear(ch, 8)

        def forward(self, x):
            h = self.stem(x)
            for bn in self.bns:
                h = h + self.relu(bn(self.conv(h)))
            return self.head(h.mean((2, 3)))

    model = Looped()
    with torch.no_grad():
        model.bns[bad].bias.fill_(-8.0)  # the bug
    per_call = _PerCall(model.relu, model)
    sample = image_templates(g, 16)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)

    def after_step(step, loss):
        if (step + 1) % 25 == 0:
            per_call.end_window()

    losses = record_loop(model, run_dir, lambda s: sample(32, 2.0), 150, opt, F.cross_entropy,
                         after_step=after_step)
    per_call.remove()
    h = per_call.history
    # The oracle: our hook, per call of the shared `relu`: call 2 100 % dead in every window, the
    # other calls' dead shares under 25 %; the net still learns.
    assert sorted(h) == list(range(iters)) and min(h[bad]) == 1.0, h
    assert all(max(h[k]) < 0.25 for k in h if k != bad), h
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.7 * sum(losses[:20]), losses[::10]
    return Oracle("dead_relu", step=0, where=["relu"], step_tolerance=50,
                  evidence={"dead_share_per_call_per_25_steps": h, "dead_call": bad, "beta": -8.0,
                            "loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20})


# -- a NaN/-Inf born in a weightless submodule --------------------------------------------------------

class _FirstNonfinite:
    """The nonfinite oracle: forward hooks on every module; the first (step, module) whose output
    holds a NaN/Inf while every tensor input is finite. Hooks run innermost first, so the first
    such module of a step is the innermost that made it."""

    def __init__(self, model: nn.Module):
        self.step, self.found, self.nan_in = 0, None, {}
        self._h = [m.register_forward_hook(self._hook(n)) for n, m in model.named_modules() if n]

    def _hook(self, name):
        def hook(module, args, out):
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t)]
            if self.found is None and all(torch.isfinite(a).all() for a in args if torch.is_tensor(a)) \
                    and not all(torch.isfinite(t).all() for t in outs):
                self.found = {"step": self.step, "module": name, "type": type(module).__name__,
                              "neg_inf": sum(int(torch.isneginf(t).sum()) for t in outs),
                              "nan": sum(int(torch.isnan(t).sum()) for t in outs)}
            if self.found is not None and self.step == self.found["step"] and name not in self.nan_in:
                self.nan_in[name] = sum(int(torch.isnan(t).sum()) for t in outs)
        return hook


class _LogEnergy(nn.Module):
    """log of each frame's mean energy (no floor, no dither)."""

    def forward(self, frames):
        return torch.log(frames.pow(2).mean(-1, keepdim=True))


class _Frontend(nn.Module):
    """Frames a waveform; a learned filterbank's log-magnitudes and the frame log-energy,
    concatenated; optionally CMVN (per-utterance mean/variance normalisation) in this forward."""

    def __init__(self, frame: int = 64, n_filt: int = 15, cmvn: bool = True):
        super().__init__()
        self.frame, self.cmvn = frame, cmvn
        self.filterbank = nn.Linear(frame, n_filt)
        self.log_energy = _LogEnergy()

    def forward(self, wave):
        frames = wave.unfold(1, self.frame, self.frame // 2)
        feats = torch.cat([torch.log1p(self.filterbank(frames).pow(2)), self.log_energy(frames)], -1)
        if self.cmvn:
            feats = (feats - feats.mean(1, keepdim=True)) / (feats.std(1, keepdim=True) + 1e-5)
        return feats


def _tones(g: torch.Generator, n: int = 32, length: int = 1024, n_cls: int = 4):
    """Keyword-spotting stand-in: a class is a tone's frequency band, under background noise."""
    t = torch.arange(length).float()

    def sample(pad_one: bool = False):
        y = torch.randint(0, n_cls, (n,), generator=g)
        f = (0.03 + 0.05 * y.float() + 0.02 * torch.rand(n, generator=g))[:, None]
        env = torch.sigmoid((t - 200 * torch.rand(n, 1, generator=g)) / 20)
        wave = env * torch.sin(2 * math.pi * f * t + 6.3 * torch.rand(n, 1, generator=g))
        wave = wave + 0.3 * torch.randn(n, length, generator=g)
        if pad_one:  # one clip 60 % long, zero-padded to the full length (digital silence)
            wave[3, int(0.6 * length):] = 0.0
        return wave, y

    return sample


@scenario("fresh3_cnn_kws_log_energy_cmvn_nan", "cnn", "nonfinite", "mid",
          "a keyword-spotting front-end's log frame energy with no energy floor and no dither (Kaldi's "
          "compute-mfcc-feats has --energy-floor and --dither for this): at step 37 a short clip zero-padded to "
          "1 s (as Speech Commands loaders pad) gives log(0) = -Inf in LogEnergy, and the parent front-end's "
          "CMVN (x - mean) / std turns it into NaN", fresh=True)
def fresh3_cnn_kws_log_energy_cmvn_nan(run_dir: str) -> Oracle:
    g = seed_all(602)
    bad = 37
    sample = _tones(g)

    class KWS(nn.Module):
        def __init__(self):
            super().__init__()
            self.frontend = _Frontend(cmvn=True)
            self.conv = nn.Sequential(nn.Conv1d(16, 32, 5, padding=2), nn.ReLU(), nn.Conv1d(32, 32, 5, padding=2),
                                      nn.ReLU())
            self.head = nn.Linear(32, 4)

        def forward(self, wave):
            return self.head(self.conv(self.frontend(wave).transpose(1, 2)).mean(-1))

    model = KWS()
    oracle = _FirstNonfinite(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, lambda s: sample(pad_one=s == bad), 60, opt, F.cross_entropy,
                         after_step=lambda s, l: setattr(oracle, "step", s + 1))
    # The oracle: the first module whose output is non-finite from finite inputs (our hooks) is
    # frontend.log_energy, at step 37 (-Inf); its parent's output that step holds NaN; the loss is
    # finite before and NaN at that step.
    f = oracle.found
    assert f and f["step"] == bad and f["module"] == "frontend.log_energy" and f["neg_inf"] > 0, f
    assert oracle.nan_in["frontend"] > 0 and oracle.nan_in["frontend.log_energy"] == 0, oracle.nan_in
    assert all(map(math.isfinite, losses[:bad])) and math.isnan(losses[bad]), losses[bad - 2:bad + 2]
    assert sum(losses[bad - 10:bad]) < 0.8 * sum(losses[:10]), losses[:bad]
    return Oracle("nonfinite", step=bad, where=["frontend.log_energy"], step_tolerance=0,
                  evidence={**f, "nan_in_parent_output": oracle.nan_in["frontend"], "loss_at_step": losses[bad],
                            "loss_before": losses[bad - 1]})


@scenario("fresh3_lstm_log_energy_inf_nan_grad", "rnn", "nonfinite", "mid",
          "log frame energy without a floor (Kaldi --energy-floor) on a zero-padded clip at step 53: the -Inf "
          "feature saturates the LSTM's gates (sigmoid/tanh of +-Inf), so the forward and the loss stay finite "
          "while weight_ih's gradient is 0 * Inf = NaN (IEEE 754); the NaN is born in LogEnergy", fresh=True)
def fresh3_lstm_log_energy_inf_nan_grad(run_dir: str) -> Oracle:
    g = seed_all(603)
    bad = 53
    sample = _tones(g, length=512)

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.frontend = _Frontend(cmvn=False)
            self.lstm = nn.LSTM(16, 32, batch_first=True)
            self.head = nn.Linear(32, 4)

        def forward(self, wave):
            return self.head(self.lstm(self.frontend(wave))[0].mean(1))

    model = Tagger()
    oracle = _FirstNonfinite(model)
    nan_grads = {}

    def look(step):
        n = grad_norms(model)
        if not nan_grads and not all(map(math.isfinite, n.values())):
            nan_grads.update(step=step, params=sorted(k for k, v in n.items() if not math.isfinite(v)))

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, lambda s: sample(pad_one=s == bad), 70, opt, F.cross_entropy,
                         before_update=look, after_step=lambda s, l: setattr(oracle, "step", s + 1))
    # The oracle: at step 53 the first module whose output is non-finite from finite inputs is
    # frontend.log_energy (-Inf); the LSTM's output and the loss are finite that step, p.grad of
    # the LSTM's input weights is NaN.
    f = oracle.found
    assert f and f["step"] == bad and f["module"] == "frontend.log_energy", f
    assert oracle.nan_in["lstm"] == 0 and math.isfinite(losses[bad]) and all(map(math.isfinite, losses[:bad])), \
        (oracle.nan_in, losses[bad])
    assert nan_grads.get("step") == bad and "lstm.weight_ih_l0" in nan_grads["params"], nan_grads
    return Oracle("nonfinite", step=bad, where=["frontend.log_energy"], step_tolerance=0,
                  evidence={**f, "params_with_nan_grad": nan_grads["params"], "loss_at_step": losses[bad],
                            "loss_after": losses[bad + 1]})


@scenario("fresh3_swin_sar_db_nodata_nan", "swin", "nonfinite", "mid",
          "SAR backscatter converted to decibels (10 log10) inside the model; Sentinel-1 GRD products mark "
          "no-data pixels with 0 (ESA Sentinel-1 product specification), so at step 60 a scene with a no-data "
          "swath edge gives -Inf in ToDecibel, and the parent's per-image standardisation makes it NaN", fresh=True)
def fresh3_swin_sar_db_nodata_nan(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(604)
    bad = 60
    sample = image_templates(g, 32)

    class ToDecibel(nn.Module):
        def forward(self, x):
            return 10.0 * torch.log10(x)

    class SARPreprocess(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_db = ToDecibel()

        def forward(self, x):
            db = self.to_db(x)
            return (db - db.mean((1, 2, 3), keepdim=True)) / db.std((1, 2, 3), keepdim=True)

    class SARClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.prep = SARPreprocess()
            self.backbone = tf.SwinForImageClassification(tf.SwinConfig(
                image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                window_size=4, num_labels=8))

        def forward(self, pixel_values, labels):
            return self.backbone(pixel_values=self.prep(pixel_values), labels=labels)

    def batch(step):  # linear intensity: reflectivity exp(template) times exponential speckle
        x, y = sample(32, 0.5)
        inten = torch.exp(x) * -torch.log(torch.rand(x.shape, generator=g).clamp_min(1e-7))
        if step == bad:
            inten[7, :, :, :5] = 0.0  # a scene at the swath edge: no-data columns
        return {"pixel_values": inten, "labels": y}, None

    model = SARClassifier()
    oracle = _FirstNonfinite(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = record_loop(model, run_dir, batch, 75, opt, after_step=lambda s, l: setattr(oracle, "step", s + 1))
    f = oracle.found
    assert f and f["step"] == bad and f["module"] == "prep.to_db" and f["neg_inf"] > 0, f
    assert oracle.nan_in["prep"] > 0 and oracle.nan_in["prep.to_db"] == 0, oracle.nan_in
    assert all(map(math.isfinite, losses[:bad])) and math.isnan(losses[bad]), losses[bad - 2:bad + 2]
    assert sum(losses[bad - 10:bad]) < 0.9 * sum(losses[:10]), losses[:bad]
    return Oracle("nonfinite", step=bad, where=["prep.to_db"], step_tolerance=0,
                  evidence={**f, "nan_in_parent_output": oracle.nan_in["prep"], "loss_before": losses[bad - 1]})
