"""Recurrent scenarios (family "rnn"): nn.RNN, nn.LSTM and nn.GRU on synthetic sequence tasks.

Tasks (all generated here, seeded):
- noisy sine classification: is the sequence a sine of frequency 1 or 3 (random phase, noise);
- a memory task: a one-hot cue token at the first step, blanks (zero vectors) after it, the label
  is the cue (Bengio et al. 1994's information latching; Hochreiter & Schmidhuber 1997);
- Poisson counts whose log-rate is a function of the sequence;
- a character-level next-token task from a small random Markov chain.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, grad_norms, record_loop, rss_mib, scenario, seed_all

FAMILY = "rnn"


# -- tasks ---------------------------------------------------------------------------------------

def _sine_task(g: torch.Generator, batch: int = 32, length: int = 40, noise: float = 0.3):
    """(B, T, 1) noisy sines of frequency 1 (class 0) or 3 (class 1), random phase."""
    t = torch.linspace(0, 3 * math.pi, length)

    def make(step: int):
        cls = torch.randint(0, 2, (batch,), generator=g)
        phase = torch.rand(batch, 1, generator=g) * 2 * math.pi
        x = torch.sin((1 + 2 * cls[:, None].float()) * t[None] + phase) + noise * torch.randn(batch, length, generator=g)
        return x[..., None], cls

    return make


class SeqClassifier(nn.Module):
    """An RNN/LSTM/GRU reading the sequence; a linear head on the last hidden state."""

    def __init__(self, cell: str = "rnn", n_in: int = 1, hidden: int = 32, n_out: int = 2, **kw):
        super().__init__()
        self.rnn = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[cell](n_in, hidden, batch_first=True, **kw)
        self.head = nn.Linear(hidden, n_out)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _set_spectral_radius(w: torch.Tensor, radius: float, g: torch.Generator) -> None:
    """w <- a Gaussian matrix rescaled so that its largest |eigenvalue| is `radius`."""
    with torch.no_grad():
        m = torch.randn(w.shape, generator=g)
        w.copy_(m * (radius / float(torch.linalg.eigvals(m).abs().max())))


def _radius(w: torch.Tensor) -> float:
    return float(torch.linalg.eigvals(w.detach().float()).abs().max())


# -- exploding gradients ----------------------------------------------------------------------------

@scenario("rnn_exploding_spectral_radius_init", FAMILY, "exploding_gradients", "init",
          "Pascanu, Mikolov & Bengio 2013, 'On the difficulty of training recurrent neural networks': "
          "a recurrent matrix with spectral radius > 1 makes the gradients through time grow "
          "exponentially with the sequence length")
def rnn_exploding_spectral_radius_init(run_dir: str) -> Oracle:
    g = seed_all(10)
    length = 100
    task = _sine_task(g, length=length)
    model = SeqClassifier("rnn")
    _set_spectral_radius(model.rnn.weight_hh_l0, 3.0, g)
    # The healthy reference: the same architecture with an orthogonal recurrent matrix (radius 1),
    # the usual init (Saxe et al. 2014; Le et al. 2015), on the same first batch.
    ref = SeqClassifier("rnn")
    ref.load_state_dict(model.state_dict())
    nn.init.orthogonal_(ref.rnn.weight_hh_l0, generator=g)
    x0, y0 = task(0)
    F.cross_entropy(ref(x0), y0).backward()
    ref_hh = grad_norms(ref)["rnn.weight_hh_l0"]
    ref_ratio = ref_hh / grad_norms(ref)["head.weight"]

    first = {"x": (x0, y0)}

    def batch(step):
        return first.pop("x") if step == 0 else task(step)

    hh, ih, head = [], [], []

    def look(step):
        n = grad_norms(model)
        hh.append(n["rnn.weight_hh_l0"]), ih.append(n["rnn.weight_ih_l0"]), head.append(n["head.weight"])

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 80, opt, F.cross_entropy, before_update=look)
    # The oracle: the first step whose recurrent gradient norm is over 1e3 times the healthy
    # reference's on the same batch, and over 1e3 times the head's (first/last layer ratio; the
    # healthy reference's ratio is O(1)).
    bad = [a > 1e3 * ref_hh and a / b > 1e3 for a, b in zip(hh, head)]
    step = bad.index(True) if True in bad else None
    assert step == 0 and sum(bad) >= 0.5 * len(bad), (hh[:5], head[:5], ref_hh)
    return Oracle("exploding_gradients", step=step, where=["rnn"], step_tolerance=0,
                  evidence={"spectral_radius": 3.0, "seq_len": length, "grad_weight_hh_step0": hh[0],
                            "grad_weight_ih_step0": ih[0], "grad_head_step0": head[0],
                            "healthy_ref_grad_weight_hh": ref_hh, "healthy_ref_hh_over_head": ref_ratio,
                            "hh_over_head_step0": hh[0] / head[0], "share_of_steps_exploded": sum(bad) / len(bad),
                            "loss_first": losses[0], "loss_last": losses[-1]})


@scenario("rnn_exploding_lr_jump", FAMILY, "exploding_gradients", "mid",
          "Pascanu et al. 2013 (gradient 'cliffs' of RNNs; clipping as the remedy): a learning rate "
          "raised 50x mid-run pushes the recurrent matrix past spectral radius 1 and the gradients explode")
def rnn_exploding_lr_jump(run_dir: str) -> Oracle:
    g = seed_all(11)
    task = _sine_forecast(g)

    class RNNForecaster(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.RNN(1, 32, batch_first=True)
            self.head = nn.Linear(32, 1)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    model = RNNForecaster()
    nn.init.orthogonal_(model.rnn.weight_hh_l0, generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    jump = 120
    norms, radius = [], []

    def look(step):
        if step == jump:
            for pg in opt.param_groups:
                pg["lr"] *= 50  # from the update of step `jump` on
        norms.append(grad_norms(model))

    losses = record_loop(model, run_dir, task, 200, opt, F.mse_loss, before_update=look,
                         after_step=lambda s, l: radius.append(_radius(model.rnn.weight_hh_l0)))
    # The oracle: baseline = median gradient norm of weight_hh over steps 70-119 (healthy
    # training at lr 3e-3, sine forecasting); the pathology's step = the first step whose
    # weight_hh gradient norm exceeds 100x that baseline (none before the jump does). (The gradients of step jump+1 are the first computed after an
    # update at the raised lr.)
    name = "rnn.weight_hh_l0"
    base = {n: statistics.median(v[n] for v in norms[70:jump]) for n in norms[0]}
    step = next((s for s in range(jump, len(norms)) if norms[s][name] > 100 * base[name]), None)
    assert sum(losses[jump - 20:jump]) < 0.5 * sum(losses[:20]), losses[::10]  # healthy before the jump
    assert step is not None, [round(v[name], 3) for v in norms[jump - 5:jump + 30]]
    pre_max = max(v[name] for v in norms[:jump + 1])
    assert pre_max < 100 * base[name], (pre_max, base[name])  # nothing like it before the jump
    # Where: the parameters whose gradient norm rose over 100x their own baseline by the end of
    # the first 10 steps of the explosion.
    peak = {n: max(v[n] for v in norms[step:step + 10]) for n in base}
    where = sorted(n for n in base if peak[n] > 100 * base[n])
    assert name in where, where
    return Oracle("exploding_gradients", step=step, where=where, step_tolerance=2,
                  evidence={"lr_jump_step": jump, "lr": [3e-3, 0.15], "baseline_grad_weight_hh": base[name],
                            "grad_weight_hh_at_step": norms[step][name], "peak_over_baseline":
                                {n: peak[n] / base[n] for n in base},
                            "max_grad_weight_hh_before": pre_max,
                            "spectral_radius_before_jump": radius[jump - 1], "spectral_radius_at_step": radius[step],
                            "loss_before_jump": losses[jump - 1], "loss_max_after": max(losses[jump:])})


# -- vanishing gradients ------------------------------------------------------------------------------

@scenario("rnn_vanishing_small_radius_init", FAMILY, "vanishing_gradients", "init",
          "Bengio, Simard & Frasconi 1994, 'Learning long-term dependencies with gradient descent is "
          "difficult': a tanh RNN with a contracting recurrent matrix (spectral radius 0.5) on a "
          "40-step memory task; the gradient reaching the input projection decays like 0.5^39")
def rnn_vanishing_small_radius_init(run_dir: str) -> Oracle:
    g = seed_all(12)
    n_sym, length, batch_size = 4, 40, 32

    class MemoryNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(n_sym, 16, bias=False)  # blanks (zero vectors) embed to zero
            self.rnn = nn.RNN(16, 32, batch_first=True)
            self.head = nn.Linear(32, n_sym)

        def forward(self, x):
            out, _ = self.rnn(self.embed(x))
            return self.head(out[:, -1])

    def batch(step):
        cue = torch.randint(0, n_sym, (batch_size,), generator=g)
        x = torch.zeros(batch_size, length, n_sym)
        x[torch.arange(batch_size), 0, cue] = 1.0  # the cue at t=0, blanks after it
        return x, cue

    model = MemoryNet()
    _set_spectral_radius(model.rnn.weight_hh_l0, 0.5, g)
    # The healthy reference: orthogonal recurrent matrix (radius 1), same batch.
    ref = MemoryNet()
    ref.load_state_dict(model.state_dict())
    nn.init.orthogonal_(ref.rnn.weight_hh_l0, generator=g)
    x0, y0 = batch(0)
    F.cross_entropy(ref(x0), y0).backward()
    rn = grad_norms(ref)
    first = {"x": (x0, y0)}

    norms = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = record_loop(model, run_dir, lambda s: first.pop("x") if s == 0 else batch(s), 150, opt,
                         F.cross_entropy, before_update=lambda s: norms.append(grad_norms(model)))
    # The oracle: the first step whose input-projection gradient norms (embed.weight and
    # rnn.weight_ih_l0) are both below 1e-6 times the head's gradient norm (the last layer), while
    # the healthy reference's ratio on the same batch is far above that; and the task is not
    # learnt (the loss stays near log 4, chance).
    def vanished(n):
        return max(n["embed.weight"], n["rnn.weight_ih_l0"]) < 1e-6 * n["head.weight"]

    flags = [vanished(n) for n in norms]
    step = flags.index(True) if True in flags else None
    ref_ratio = max(rn["embed.weight"], rn["rnn.weight_ih_l0"]) / rn["head.weight"]
    assert step == 0 and all(flags), [(n["embed.weight"], n["head.weight"]) for n in norms[:3]]
    assert ref_ratio > 1e-3, ref_ratio
    assert sum(losses[-20:]) / 20 > 0.9 * math.log(n_sym), losses[-20:]
    return Oracle("vanishing_gradients", step=step, where=["embed.weight", "rnn.weight_ih_l0"], step_tolerance=0,
                  evidence={"spectral_radius": 0.5, "seq_len": length,
                            "grad_embed_step0": norms[0]["embed.weight"], "grad_weight_ih_step0": norms[0]["rnn.weight_ih_l0"],
                            "grad_head_step0": norms[0]["head.weight"],
                            "grad_weight_hh_step0": norms[0]["rnn.weight_hh_l0"],
                            "input_over_head_max_all_steps": max(max(n["embed.weight"], n["rnn.weight_ih_l0"]) / n["head.weight"] for n in norms),
                            "healthy_ref_input_over_head": ref_ratio,
                            "loss_first": losses[0], "loss_last20_mean": sum(losses[-20:]) / 20, "chance": math.log(n_sym)})


# -- non-finite values ---------------------------------------------------------------------------

@scenario("rnn_nonfinite_exp_rate_overflow", FAMILY, "nonfinite", "mid",
          "Poisson regression with an exp link (McCullagh & Nelder, GLMs): a corrupt count (1e7) at "
          "step 80 gives a huge SGD update, and the next step's exp overflows to +Inf in the weightless "
          "Exp module")
def rnn_nonfinite_exp_rate_overflow(run_dir: str) -> Oracle:
    g = seed_all(13)

    class Exp(nn.Module):  # the inverse link: rate = exp(log-rate)
        def forward(self, z):
            return torch.exp(z)

    class CountModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(2, 24, batch_first=True)
            self.head = nn.Linear(24, 1)
            self.rate = Exp()

        def forward(self, x):
            out, _ = self.gru(x)
            return self.rate(self.head(out[:, -1]).squeeze(-1))

    bad_step = 80

    def batch(step):
        x = torch.randn(32, 20, 2, generator=g)
        rate = torch.exp(0.5 * torch.tanh(x[:, :, 0].mean(1) * 3) + 1.0)
        y = torch.poisson(rate, generator=g)
        if step == bad_step:
            y[5] = 1e7  # a corrupt record
        return x, y

    model = CountModel()
    state = {"step": 0, "first": None, "loss_finite_before": True}

    def hook(module, args, out):
        if torch.is_grad_enabled() and state["first"] is None and not torch.isfinite(out).all() \
                and torch.isfinite(args[0]).all():
            state["first"] = state["step"]
            state["kind"] = "+inf" if torch.isposinf(out).any() else "nan"

    model.rate.register_forward_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = record_loop(model, run_dir, batch, 120, opt,
                         lambda rate, y: F.poisson_nll_loss(rate, y, log_input=False),
                         after_step=lambda s, l: state.__setitem__("step", s + 1))
    # The oracle: the first step whose Exp output holds a non-finite value while its input is
    # finite (our forward hook); every loss before it finite.
    step = state["first"]
    assert step is not None and step > bad_step and all(map(math.isfinite, losses[:step])), (step, losses[75:90])
    return Oracle("nonfinite", step=step, where=["rate"], step_tolerance=0,
                  evidence={"corrupt_record_step": bad_step, "first_nonfinite_output_step": step,
                            "value": state["kind"], "loss_at_corrupt_step": losses[bad_step],
                            "loss_at_step": losses[step]})


@scenario("rnn_nonfinite_sqrt_backward_empty_sequence", FAMILY, "nonfinite", "mid",
          "the derivative of sqrt at 0 is infinite: an RMS normalisation of a masked-mean-pooled "
          "LSTM state gives 0 * inf = NaN in backward for an empty (fully padded) sequence "
          "(PyTorch issue #2421 'Gradient of zero norm is nan' and PR #2775: .pow(2).sum().sqrt() "
          "still gives NaN at 0); the forward stays finite")
def rnn_nonfinite_sqrt_backward_empty_sequence(run_dir: str) -> Oracle:
    g = seed_all(14)

    class MaskedMean(nn.Module):
        def forward(self, out, mask):
            m = mask[..., None].to(out.dtype)
            return (out * m).sum(1) / m.sum(1).clamp_min(1.0)

    class RMSScale(nn.Module):  # y = h / (sqrt(mean h^2) + eps): finite forward at h = 0
        def forward(self, h):
            return h / (torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + 1e-6)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(1, 32, batch_first=True)
            self.pool = MaskedMean()
            self.norm = RMSScale()
            self.head = nn.Linear(32, 2)

        def forward(self, x, mask):
            out, _ = self.lstm(x)
            return self.head(self.norm(self.pool(out, mask)))

    sine = _sine_task(g, length=30)
    empty_step = 70

    def batch(step):
        x, y = sine(step)
        lengths = torch.randint(10, 31, (32,), generator=g)
        if step == empty_step:
            lengths[3] = 0  # an empty record: every position padding
        mask = torch.arange(30)[None] < lengths[:, None]
        return (x * mask[..., None], mask), y

    model = Net()
    state = {"step": 0, "fwd_nonfinite": None, "born": None}

    def fwd_hook(module, args, out):
        if torch.is_grad_enabled() and state["fwd_nonfinite"] is None and not torch.isfinite(out[0] if isinstance(out, tuple) else out).all():
            state["fwd_nonfinite"] = state["step"]

    for m in model.modules():
        m.register_forward_hook(fwd_hook)

    def bwd_hook(module, grad_input, grad_output):
        # Born here: the gradient at the module's output finite, at its input not.
        if state["born"] is None and torch.isfinite(grad_output[0]).all() and not torch.isfinite(grad_input[0]).all():
            state["born"] = state["step"]

    model.norm.register_full_backward_hook(bwd_hook)
    nonfinite_grads = {}

    def look(step):
        n = grad_norms(model)
        if not nonfinite_grads and not all(map(math.isfinite, n.values())):
            nonfinite_grads.update(step=step, params=sorted(k for k, v in n.items() if not math.isfinite(v)),
                                   finite=sorted(k for k, v in n.items() if math.isfinite(v)))

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, batch, 100, opt, F.cross_entropy, before_update=look,
                         after_step=lambda s, l: state.__setitem__("step", s + 1))
    # The oracle: the first step whose parameter gradients hold NaN (from p.grad) while that
    # step's forward (every module's output, our hooks) and loss were finite, with RMSScale's
    # backward the place it is born (finite gradient at its output, NaN at its input). The
    # gradients that went non-finite: the LSTM's (upstream of the norm); the head's stayed finite.
    step = nonfinite_grads.get("step")
    assert step == empty_step and state["born"] == step and (state["fwd_nonfinite"] is None or state["fwd_nonfinite"] > step) \
        and math.isfinite(losses[step]), (nonfinite_grads, state, losses[step])
    assert all(p.startswith("lstm.") for p in nonfinite_grads["params"]), nonfinite_grads
    return Oracle("nonfinite", step=step, where=["norm"] + nonfinite_grads["params"], step_tolerance=0,
                  evidence={"empty_sequence_step": empty_step, "born_in_backward_of": "norm (sqrt at 0)",
                            "params_with_nan_grad": nonfinite_grads["params"],
                            "params_with_finite_grad": nonfinite_grads["finite"], "loss_at_step": losses[step],
                            "forward_nonfinite_first_step": state["fwd_nonfinite"]})


# -- memory leak ---------------------------------------------------------------------------------

@scenario("rnn_memory_leak_kept_outputs", FAMILY, "memory_leak", "init",
          "PyTorch FAQ, 'Don't accumulate history across your training loop': every step's logits "
          "(with their autograd history) kept in a list for an end-of-epoch metric")
def rnn_memory_leak_kept_outputs(run_dir: str) -> Oracle:
    g = seed_all(15)
    vocab, length, batch_size = 256, 32, 32
    trans = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), -1)  # a random Markov chain

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, 32)
            self.lstm = nn.LSTM(32, 64, batch_first=True)
            self.head = nn.Linear(64, vocab)

        def forward(self, x):
            out, _ = self.lstm(self.embed(x))
            return self.head(out)

    def batch(step):
        seq = torch.empty(batch_size, length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
        for t in range(length):
            seq[:, t + 1] = torch.multinomial(trans[seq[:, t]], 1, generator=g)[:, 0]
        return seq[:, :-1], seq[:, 1:]

    kept = []  # the bug: epoch_outputs.append(logits), never detached nor cleared

    def loss_fn(logits, y):
        kept.append(logits)
        return F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))

    model = CharLM()
    rss = []
    steps = 200
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, batch, steps, opt, loss_fn, after_step=lambda s, l: rss.append(rss_mib()))
    # The oracle: resident memory grows steadily by about what the kept logits hold
    # (B*T*vocab*4 bytes a step), from the first step; every kept tensor still has its graph.
    per_step = batch_size * length * vocab * 4 / 2**20
    n = len(rss)
    xs = list(range(n))
    mx, my = sum(xs) / n, sum(rss) / n
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, rss)) / sum((a - mx) ** 2 for a in xs)
    growth = rss[-1] - rss[10]
    assert growth > 0.7 * per_step * (n - 11) and slope > 0.7 * per_step, (growth, slope, per_step)
    assert all(t.grad_fn is not None for t in kept)
    # The leak holds from step 0 (the first append); step = 0.
    return Oracle("memory_leak", step=0, where=[], step_tolerance=50,
                  evidence={"rss_mib_step10": rss[10], "rss_mib_last": rss[-1], "growth_mib": growth,
                            "slope_mib_per_step": slope, "expected_mib_per_step": per_step,
                            "kept_tensors_with_graph": len(kept), "loss_first": losses[0], "loss_last": losses[-1]})


# -- healthy controls ----------------------------------------------------------------------------

def _sine_forecast(g: torch.Generator, batch: int = 32, length: int = 40, noise: float = 0.1):
    """One-step-ahead forecasting of noisy sines (random frequency in [0.5, 2], random phase):
    inputs x_0..x_{T-1}, targets x_1..x_T, both (B, T, 1)."""
    t = torch.arange(length + 1).float() * 0.3

    def make(step: int):
        freq = 0.5 + 1.5 * torch.rand(batch, 1, generator=g)
        phase = torch.rand(batch, 1, generator=g) * 2 * math.pi
        s = torch.sin(freq * t[None] + phase) + noise * torch.randn(batch, length + 1, generator=g)
        return s[:, :-1, None], s[:, 1:, None]

    return make


class Forecaster(nn.Module):
    def __init__(self, cell: str, hidden: int = 32, autocast: bool = False):
        super().__init__()
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)
        self.autocast = autocast

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            return self.head(self.rnn(x)[0])


def _healthy(run_dir: str, model: nn.Module, opt, task, clip=None) -> Oracle:
    total = []
    losses = record_loop(model, run_dir, task, 200, opt, lambda out, y: F.mse_loss(out.float(), y), clip=clip,
                         before_update=lambda s: total.append(math.sqrt(sum(v * v for v in grad_norms(model).values()))))
    # The oracle of health: the loss falls clearly (below a fifth of its start), everything
    # finite, and the raw gradient norm (before any clipping) never above 10x its median.
    assert all(map(math.isfinite, losses + total))
    assert sum(losses[-20:]) < 0.2 * sum(losses[:20]), losses[::20]
    assert max(total) < 10 * statistics.median(total), (max(total), statistics.median(total))
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "grad_norm_median": statistics.median(total), "grad_norm_max": max(total)})


@scenario("rnn_healthy_lstm_clip_adam", FAMILY, None, "healthy",
          "the usual recurrent recipe: LSTM (Hochreiter & Schmidhuber 1997), Adam, gradient-norm "
          "clipping at 1 (Pascanu et al. 2013), on sine forecasting")
def rnn_healthy_lstm_clip_adam(run_dir: str) -> Oracle:
    g = seed_all(16)
    model = Forecaster("lstm")
    return _healthy(run_dir, model, torch.optim.Adam(model.parameters(), lr=3e-3), _sine_forecast(g), clip=1.0)


@scenario("rnn_healthy_gru_bf16_autocast", FAMILY, None, "healthy",
          "mixed precision on CPU: torch.autocast('cpu', dtype=torch.bfloat16) (PyTorch AMP docs), "
          "GRU (Cho et al. 2014), AdamW with weight decay, on sine forecasting")
def rnn_healthy_gru_bf16_autocast(run_dir: str) -> Oracle:
    g = seed_all(17)
    model = Forecaster("gru", autocast=True)
    return _healthy(run_dir, model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), _sine_forecast(g))
