"""Fresh exploding-gradient scenarios (split "fresh": written after the thresholds were tuned, held
out from all tuning). Each is a short real training run recorded by the default Recorder; the
oracle is measured from p.grad (before the optimizer step) by the scenario itself.

Definitions used by the oracles:
- from initialisation: the first (input-side) weight's gradient norm exceeds 1e3 x that of the
  last hidden weight at step 0, and the median of that ratio over the whole run stays > 1e2;
  where = the parameters whose gradient norm at step 0 exceeds 100x the last hidden weight's.
- arising mid-run: the first step whose total gradient norm exceeds 100x its median over healthy
  steps before the change (no step before the change does); where = the parameters whose own
  gradient norm grew the most against their own median over those healthy steps (the top few).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, first_step, grad_norms, record_loop, scenario, seed_all


# -- shared helpers ------------------------------------------------------------------------------

def _total(norms: dict[str, float]) -> float:
    return math.sqrt(sum(v * v for v in norms.values() if math.isfinite(v)))


def _first_batch_twice(data):
    """(data(0), batch): batch(step) serves that same first batch at step 0, so that a reference
    model can be measured on exactly what the recorded model's first step sees."""
    first = data(0)
    return first, (lambda step: first if step == 0 else data(step))


def _init_oracle(norms: list[dict], first: str, last: str, min_where: int = 1, **evidence) -> Oracle:
    """The from-initialisation definition (module docstring), asserted."""
    ratios = [n[first] / n[last] for n in norms]
    step = first_step(ratios, lambda r: r > 1e3)
    med = statistics.median(ratios)
    assert step == 0 and med > 1e2, (ratios[:5], med)
    where = [p for p, v in norms[0].items() if v > 100 * norms[0][last]]
    assert len(where) >= min_where and first in where, where
    return Oracle("exploding_gradients", step=0, where=where, step_tolerance=1,
                  evidence={"first_over_last_hidden_step0": ratios[0], "median_ratio": med,
                            "min_ratio": min(ratios), "grad_first_step0": norms[0][first],
                            "grad_last_hidden_step0": norms[0][last], "first": first, "last_hidden": last,
                            **evidence})


def _mid_oracle(norms: list[dict], change: int, base_from: int, losses: list[float], top: int = 5,
                **evidence) -> Oracle:
    """The mid-run definition (module docstring), asserted; `change` is the first step that could
    be affected by the cause (the healthy window is [base_from, change))."""
    total = [_total(n) for n in norms]
    base = statistics.median(total[base_from:change])
    onset = first_step(total, lambda v: not v <= 100 * base)
    assert onset is not None and onset >= change, (onset, [round(t / base, 1) for t in total[change - 3:]])
    assert all(map(math.isfinite, total + losses)), "the run went non-finite: shorten it"
    own = {p: statistics.median(n[p] for n in norms[base_from:change]) for p in norms[0]}
    # (parameters whose gradient is structurally ~0, e.g. an attention key's bias, to which softmax
    # is invariant, grow from round-off only: left out)
    growth = {p: norms[onset][p] / own[p] for p in own if own[p] > 1e-6 * base}
    where = sorted((p for p in growth if growth[p] > 100), key=lambda p: -growth[p])[:top]
    assert where, growth
    return Oracle("exploding_gradients", step=onset, where=where, step_tolerance=2,
                  evidence={"healthy_median_total_grad_norm": base, "total_grad_norm_at_onset": total[onset],
                            "onset_over_median": total[onset] / base,
                            "max_before_change_over_median": max(total[:change]) / base,
                            "growth_of_where": {p: growth[p] for p in where},
                            "total_over_median_after_onset": [round(t / base, 1) for t in total[onset:onset + 10]],
                            "loss_before_change": sum(losses[change - 10:change]) / 10,
                            "loss_last": losses[-1], **evidence})


# -- exploding from initialisation ------------------------------------------------------------------

class _Sine(nn.Module):
    """SIREN's activation sin(omega_0 * x)."""

    def __init__(self, omega: float = 30.0):
        super().__init__()
        self.omega = omega

    def forward(self, x):
        return torch.sin(self.omega * x)


def _siren(siren_init: bool, width: int = 64, hidden: int = 5) -> nn.Sequential:
    layers: list = []
    for i in range(hidden):
        layers += [(f"fc{i}", nn.Linear(2 if i == 0 else width, width)), (f"sin{i}", _Sine())]
    model = nn.Sequential(OrderedDict(layers + [("out", nn.Linear(width, 3))]))
    with torch.no_grad():
        model.fc0.weight.uniform_(-1 / 2, 1 / 2)  # SIREN's first layer: U(-1/fan_in, 1/fan_in)
        if siren_init:  # SIREN's hidden layers: U(-sqrt(6/fan_in)/omega_0, +...)
            for i in range(1, hidden):
                b = math.sqrt(6 / width) / 30.0
                getattr(model, f"fc{i}").weight.uniform_(-b, b)
    return model


@scenario("fresh_mlp_siren_default_hidden_init_explodes", "mlp", "exploding_gradients", "init",
          "Sitzmann et al. 2020, 'Implicit Neural Representations with Periodic Activation Functions' "
          "(SIREN) sec. 3.2: hidden layers must be initialised U(+-sqrt(6/n)/omega_0); left at PyTorch's "
          "default init, each sin(30 Wx) layer multiplies the backward signal by ~12 (chaotic regime)",
          fresh=True)
def fresh_mlp_siren_default_hidden_init_explodes(run_dir: str) -> Oracle:
    g = seed_all(500)
    xs = torch.linspace(-1, 1, 32)
    yy, xx = torch.meshgrid(xs, xs, indexing="ij")
    coords = torch.stack([xx, yy], -1).reshape(-1, 2)
    image = torch.stack([torch.sin(3 * xx) * torch.cos(2 * yy), torch.cos(4 * xx * yy), (xx ** 2 - yy) / 2], -1)
    image = image.reshape(-1, 3)

    def data(step):  # a batch of 256 random pixels of the image to fit (coordinates -> RGB)
        idx = torch.randint(0, coords.shape[0], (256,), generator=g)
        return coords[idx], image[idx]

    model = _siren(siren_init=False)  # the bug: the hidden layers keep nn.Linear's default init
    (x0, y0), batch = _first_batch_twice(data)
    ref = _siren(siren_init=True)  # the reference: SIREN's own init, same first batch
    F.mse_loss(ref(x0), y0).backward()
    rn = grad_norms(ref)
    norms: list[dict] = []
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)  # SIREN's lr
    losses = record_loop(model, run_dir, batch, 200, opt, F.mse_loss,
                         before_update=lambda s: norms.append(grad_norms(model)))
    return _init_oracle(norms, "fc0.weight", "fc4.weight", min_where=2,
                        reference_siren_init_first_over_last_hidden=rn["fc0.weight"] / rn["fc4.weight"],
                        loss_first=losses[0], loss_last20=sum(losses[-20:]) / 20)


@scenario("fresh_cnn_tanh_fixed_std_chaotic_explodes", "cnn", "exploding_gradients", "init",
          "Xiao et al. 2018, 'Dynamical Isometry and a Mean Field Theory of CNNs: How to Train 10,000-Layer "
          "Vanilla CNNs': a tanh CNN initialised in the chaotic phase (sigma_w^2 far above critical) has "
          "gradients growing exponentially towards the input; here every conv is nn.init.normal_(std=0.5), "
          "i.e. sigma_w ~ 8.5 at fan_in 288", fresh=True)
def fresh_cnn_tanh_fixed_std_chaotic_explodes(run_dir: str) -> Oracle:
    g = seed_all(501)
    depth, ch, size = 14, 32, 16
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")

    def data(step):  # oriented gratings + noise; the class is one of 4 orientations
        y = torch.randint(4, (32,), generator=g)
        theta = y.float() * math.pi / 4
        freq = 2 * math.pi * (0.12 + 0.1 * torch.rand(32, generator=g))
        phase = 2 * math.pi * torch.rand(32, generator=g)
        proj = xx[None] * torch.cos(theta)[:, None, None] + yy[None] * torch.sin(theta)[:, None, None]
        img = torch.sin(freq[:, None, None] * proj + phase[:, None, None])
        return (img + 0.3 * torch.randn(32, size, size, generator=g))[:, None], y

    layers: list = []
    for i in range(depth):
        conv = nn.Conv2d(1 if i == 0 else ch, ch, 3, padding=1)
        nn.init.normal_(conv.weight, 0.0, 0.5)  # the bug: one fixed std for every layer
        nn.init.zeros_(conv.bias)
        layers += [(f"conv{i}", conv), (f"tanh{i}", nn.Tanh())]
    model = nn.Sequential(OrderedDict(layers + [("pool", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()),
                                                ("head", nn.Linear(ch, 4))]))
    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses = record_loop(model, run_dir, data, 100, opt, F.cross_entropy,
                         before_update=lambda s: norms.append(grad_norms(model)))
    sigma_w = 0.5 * math.sqrt(ch * 9)
    return _init_oracle(norms, "conv0.weight", f"conv{depth - 1}.weight", min_where=2, sigma_w_hidden=sigma_w,
                        per_conv_grad_step0=[norms[0][f"conv{i}.weight"] for i in range(depth)],
                        loss_first=losses[0], loss_last20=sum(losses[-20:]) / 20)


class _Forecaster(nn.Module):
    """An LSTM/GRU reading a sequence; a linear head at every step (one-step-ahead forecast)."""

    def __init__(self, cell: str, hidden: int):
        super().__init__()
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def _sines(g: torch.Generator, length: int, batch: int = 32):
    """Noisy sines of random frequency and phase: inputs x_0..x_{T-1}, targets x_1..x_T."""
    t = torch.arange(length + 1).float() * 0.3

    def make(step):
        freq = 0.5 + 1.5 * torch.rand(batch, 1, generator=g)
        phase = 2 * math.pi * torch.rand(batch, 1, generator=g)
        s = torch.sin(freq * t[None] + phase) + 0.1 * torch.randn(batch, length + 1, generator=g)
        return s[:, :-1, None], s[:, 1:, None]

    return make


def _orthogonal_gates(w: torch.Tensor, gain: float, hidden: int) -> None:
    """Each gate's (hidden x hidden) block of an LSTM/GRU weight_hh: orthogonal times gain."""
    with torch.no_grad():
        for k in range(w.shape[0] // hidden):
            nn.init.orthogonal_(w[k * hidden:(k + 1) * hidden], gain=gain)


@scenario("fresh_lstm_recurrent_gain5_init_explodes", "rnn", "exploding_gradients", "init",
          "Pascanu, Mikolov & Bengio 2013 ('On the difficulty of training RNNs'); Chen, Pennington & "
          "Schoenholz 2018 (mean-field theory of gated RNNs): recurrent weights with a large gain put a "
          "gated RNN in its chaotic regime and gradients through time explode; here each gate block of the "
          "LSTM's weight_hh is orthogonal x 5 on 100-step sequences", fresh=True)
def fresh_lstm_recurrent_gain5_init_explodes(run_dir: str) -> Oracle:
    g = seed_all(502)
    hidden = 64
    (x0, y0), batch = _first_batch_twice(_sines(g, 100))
    model = _Forecaster("lstm", hidden)
    _orthogonal_gates(model.rnn.weight_hh_l0, 5.0, hidden)  # the bug: gain 5 instead of 1
    ref = _Forecaster("lstm", hidden)  # the reference: the same weights with gain 1, same first batch
    ref.load_state_dict(model.state_dict())
    _orthogonal_gates(ref.rnn.weight_hh_l0, 1.0, hidden)
    F.mse_loss(ref(x0), y0).backward()
    rn = grad_norms(ref)
    norms: list[dict] = []
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 150, opt, F.mse_loss,
                         before_update=lambda s: norms.append(grad_norms(model)))
    # "first weight": the LSTM's input weight; "last hidden weight": the head (the LSTM is the only
    # hidden layer; the head reads its state).
    return _init_oracle(norms, "rnn.weight_ih_l0", "head.weight", min_where=2,
                        reference_gain1_ih_over_head=rn["rnn.weight_ih_l0"] / rn["head.weight"],
                        grad_weight_hh_step0=norms[0]["rnn.weight_hh_l0"],
                        loss_first20=sum(losses[:20]) / 20, loss_last20=sum(losses[-20:]) / 20)


@scenario("fresh_bert_initializer_range_0p5_explodes", "bert", "exploding_gradients", "init",
          "transformers' BertConfig.initializer_range (default 0.02) set to 0.5: in a 12-layer Post-LN "
          "encoder the residual branches then dominate every sum and each layer amplifies the backward "
          "signal (Liu et al. 2020, 'Understanding the Difficulty of Training Transformers'; Xiong et al. "
          "2020, 'On Layer Normalization in the Transformer Architecture')", fresh=True)
def fresh_bert_initializer_range_0p5_explodes(run_dir: str) -> Oracle:
    import transformers
    from transformers import BertConfig, BertForSequenceClassification

    transformers.logging.set_verbosity_error()
    g = seed_all(503)
    V, T, layers = 64, 32, 12

    def model_with(init_range):
        return BertForSequenceClassification(BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=T, num_labels=2, pad_token_id=0, initializer_range=init_range,
            attn_implementation="eager"))

    def data(step):  # padded sequences; label: more "low" tokens (5..33) than "high" ones (34..63)
        lengths = torch.randint(8, T + 1, (32,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        ids = torch.randint(5, V, (32, T), generator=g)
        ids[:, 0] = 1
        ids = ids * mask
        y = (((ids >= 5) & (ids < 34)).sum(1) > (ids >= 34).sum(1)).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": y}, None

    (x0, _), batch = _first_batch_twice(data)
    model = model_with(0.5)
    ref = model_with(0.02)  # the reference: the default initializer_range, same first batch
    ref(**x0).loss.backward()
    rn = grad_norms(ref)
    with torch.no_grad():  # not an attention collapse: the rows' largest weight at init (dropout off)
        model.eval()
        att = model(input_ids=x0["input_ids"], attention_mask=x0["attention_mask"], output_attentions=True).attentions
        model.train()
        valid = x0["attention_mask"][:, None, :, None].bool().expand_as(att[0])[..., 0]
        max_w = [float(a.amax(-1)[valid].mean()) for a in att]
    assert max(max_w) < 0.9, max_w
    norms: list[dict] = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = record_loop(model, run_dir, batch, 150, opt,
                         before_update=lambda s: norms.append(grad_norms(model)))
    last = f"bert.encoder.layer.{layers - 1}.output.dense.weight"
    return _init_oracle(norms, "bert.embeddings.word_embeddings.weight", last, min_where=5,
                        reference_0p02_first_over_last_hidden=rn["bert.embeddings.word_embeddings.weight"] / rn[last],
                        attention_mean_max_weight_step0=max_w,
                        loss_first20=sum(losses[:20]) / 20, loss_last20=sum(losses[-20:]) / 20)


# -- exploding mid-run ---------------------------------------------------------------------------

@scenario("fresh_transformer_preln_lr_percent_bug_explodes", "transformer", "exploding_gradients", "mid",
          "a warm-up LambdaLR whose lambda returns the post-warm-up multiplier in percent (100 instead of "
          "1.0): Adam's lr jumps from 1e-3 to 0.1 at step 100 and a Pre-LN causal Transformer (no final "
          "LayerNorm) diverges, its residual stream and gradients growing (Xiong et al. 2020; Wortsman et "
          "al. 2023, 'Small-scale proxies for large-scale Transformer training instabilities')", fresh=True)
def fresh_transformer_preln_lr_percent_bug_explodes(run_dir: str) -> Oracle:
    g = seed_all(504)
    vocab, length, warm = 12, 16, 100
    trans = torch.softmax(2.0 * torch.randn(vocab - 1, vocab - 1, generator=g), -1)  # a random Markov chain

    def data(step):
        seq = torch.empty(32, length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(1, vocab, (32,), generator=g)
        for t in range(length):
            seq[:, t + 1] = 1 + torch.multinomial(trans[seq[:, t] - 1], 1, generator=g)[:, 0]
        return seq[:, :-1], seq[:, 1:]

    class CausalLM(nn.Module):
        def __init__(self, d=32):
            super().__init__()
            self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
            layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)
            self.register_buffer("causal", torch.triu(torch.ones(length, length, dtype=torch.bool), 1))

        def forward(self, x):
            h = self.embed(x) + self.pos(torch.arange(x.shape[1]))[None]
            return self.head(self.encoder(h, mask=self.causal, is_causal=True))

    model = CausalLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # The bug: after warm-up the lambda returns 100 ("100 %") instead of 1.0.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else 100.0)
    norms: list[dict] = []
    losses = record_loop(model, run_dir, data, 160, opt,
                         lambda out, y: F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1)),
                         scheduler=sched, before_update=lambda s: norms.append(grad_norms(model)))
    assert sum(losses[warm - 10:warm]) < 0.8 * sum(losses[:10]), losses[::10]  # it was learning
    # The first update at lr 0.1 is step `warm`'s; its gradients are still healthy.
    return _mid_oracle(norms, warm, 20, losses, lr=[1e-3, 0.1], lr_jump_update_step=warm)


@scenario("fresh_vit_sgd_warmup_overshoot_explodes", "vit", "exploding_gradients", "mid",
          "Goyal et al. 2017 ('Accurate, Large Minibatch SGD': warm-up to a stable lr); Gilmer et al. 2022 "
          "('A Loss Curvature Perspective on Training Instability'): once SGD's lr passes ~2/sharpness the "
          "iterates diverge; here a linear warm-up towards a peak lr of 1.0 (far too high for SGD on this "
          "ViT) crosses it mid-run", fresh=True)
def fresh_vit_sgd_warmup_overshoot_explodes(run_dir: str) -> Oracle:
    import transformers
    from transformers import ViTConfig, ViTForImageClassification

    transformers.logging.set_verbosity_error()
    g = seed_all(505)
    n_cls, warm, peak = 8, 500, 1.0
    tpl = F.avg_pool2d(torch.randn(n_cls, 3, 20, 20, generator=g), 5, 1)
    tpl = tpl / tpl.std()

    def data(step):  # class templates plus noise
        y = torch.randint(0, n_cls, (32,), generator=g)
        return {"pixel_values": tpl[y] + 1.5 * torch.randn(32, 3, 16, 16, generator=g), "labels": y}, None

    model = ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=n_cls, attn_implementation="sdpa"))
    opt = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    norms: list[dict] = []
    # Stopped (as a person watching the loss would) ~10 steps after the divergence starts, before
    # it overflows into NaN (at about step 270).
    losses = record_loop(model, run_dir, data, 268, opt, scheduler=sched,
                         before_update=lambda s: norms.append(grad_norms(model)))
    healthy_end = 150  # the healthy window: steps 20-149 (lr <= 0.3, the loss fallen from ~2.1 to ~0.8)
    assert sum(losses[healthy_end - 20:healthy_end]) < 0.6 * sum(losses[:20]), losses[::10]
    oracle = _mid_oracle(norms, healthy_end, 20, losses)
    assert oracle.step >= healthy_end + 50, oracle.step  # well after the healthy window: not a start-up transient
    oracle.evidence["lr_at_onset"] = peak * min(1.0, (oracle.step + 1) / warm)
    return oracle


@scenario("fresh_gru_millimetre_units_shift_explodes", "rnn", "exploding_gradients", "mid",
          "LeCun et al. 1998, 'Efficient BackProp' sec. 4.3 (unnormalised inputs and targets scale the "
          "gradients); a data-source change at step 130 delivers water levels in millimetres instead of "
          "metres (x1000, inputs and targets) to a GRU forecaster trained with MSE", fresh=True)
def fresh_gru_millimetre_units_shift_explodes(run_dir: str) -> Oracle:
    g = seed_all(506)
    shift = 130
    sines = _sines(g, 40)

    def data(step):
        x, y = sines(step)
        return (1000.0 * x, 1000.0 * y) if step >= shift else (x, y)

    model = _Forecaster("gru", 32)
    norms: list[dict] = []
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, data, 170, opt, F.mse_loss,
                         before_update=lambda s: norms.append(grad_norms(model)))
    assert sum(losses[shift - 20:shift]) < 0.3 * sum(losses[:20]), losses[::10]  # healthy before
    oracle = _mid_oracle(norms, shift, 60, losses, units_shift_step=shift, scale=1000.0)
    assert oracle.step == shift, oracle.step
    return oracle
