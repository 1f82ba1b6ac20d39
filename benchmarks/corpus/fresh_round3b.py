"""Fresh scenarios, round 3, part b (split "fresh": written without reading the detectors or their
thresholds, held out from all tuning): recurrent nets exploding from their initialisation with
nothing healthy to compare to, a learning rate far too high from the first step, and slow memory
leaks. The oracles: p.grad norms (against a reference net with a sane init on the same first
batch, or against the run's own first step), the loss, and /proc resident memory."""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, grad_norms, hf, image_templates, record_loop, rss_mib, scenario, seed_all
from .fresh_round3a import _total


# -- exploding from initialisation: nothing to compare to ------------------------------------------

def _adding_problem(g: torch.Generator, length: int, n: int = 32):
    """Hochreiter & Schmidhuber 1997; Le et al. 2015: (values, markers) in, the sum of the two
    marked values out (a regression target of order 1)."""

    def make(step):
        vals = torch.rand(n, length, generator=g)
        marks = torch.zeros(n, length)
        first = torch.randint(0, length // 2, (n,), generator=g)
        second = torch.randint(length // 2, length, (n,), generator=g)
        marks[torch.arange(n), first] = marks[torch.arange(n), second] = 1.0
        return torch.stack([vals, marks], -1), (vals * marks).sum(1, keepdim=True)

    return make


class _ReLURNN(nn.Module):
    def __init__(self, hidden: int = 64, layers: int = 1):
        super().__init__()
        self.rnn = nn.RNN(2, hidden, num_layers=layers, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _rnn_init_oracle(model, ref, x0, y0, norms, losses, **evidence) -> Oracle:
    """Exploding from step 0, every layer alike: each recurrent parameter's gradient at step 0
    over 1e3 x the same parameter's in the reference (the same net with a sane recurrent init, the
    same first batch), the head's weight's too; the loss over 1e3 x the reference's; the total gradient norm
    over 1e3 x the reference's at every step of the run."""
    ref_loss = F.mse_loss(ref(x0), y0)
    ref_loss.backward()
    ref_loss = float(ref_loss.detach())
    rn = grad_norms(ref)
    ratio0 = {p: norms[0][p] / rn[p] for p in rn if p != "head.bias"}  # (the bias: ~ the residual, sqrt(loss))
    total = [_total(n) for n in norms]
    assert all(map(math.isfinite, total + losses)), "non-finite"
    assert all(r > 1e3 for r in ratio0.values()) and losses[0] > 1e3 * ref_loss, (ratio0, losses[0], ref_loss)
    assert min(total) > 1e3 * _total(rn), (min(total), _total(rn))
    where = ["rnn"] + [p for p in norms[0] if p.startswith("rnn.")]
    return Oracle("exploding_gradients", step=0, where=where, step_tolerance=1,
                  evidence={"grad_over_reference_step0": ratio0, "total_grad_norm_step0": total[0],
                            "reference_total_grad_norm": _total(rn), "min_total_grad_norm": min(total),
                            "loss_first": losses[0], "reference_loss": ref_loss,
                            "loss_last": losses[-1], **evidence})


@scenario("fresh3_relu_rnn_spectral_radius3_regression_explodes", "rnn", "exploding_gradients", "init",
          "Pascanu, Mikolov & Bengio 2013 ('On the difficulty of training RNNs'): a ReLU RNN whose recurrent "
          "matrix has spectral radius 3 grows its state and its gradients exponentially through time; on a "
          "regression (the adding problem, MSE) the loss and every layer's gradient are huge from step 0, and "
          "Adam's bounded steps cannot bring the radius back under 1 in the run", fresh=True)
def fresh3_relu_rnn_spectral_radius3_regression_explodes(run_dir: str) -> Oracle:
    g = seed_all(605)
    task = _adding_problem(g, 20)
    x0, y0 = task(0)
    model, ref = _ReLURNN(), _ReLURNN()
    with torch.no_grad():
        m = torch.randn(64, 64, generator=g)
        m /= torch.linalg.eigvals(m).abs().max()
        model.rnn.weight_hh_l0.copy_(3.0 * m)  # the bug: spectral radius 3
        ref.load_state_dict(model.state_dict())
        ref.rnn.weight_hh_l0.copy_(0.9 * m)  # the reference: radius 0.9
    norms: list[dict] = []
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, lambda s: (x0, y0) if s == 0 else task(s), 120, opt, F.mse_loss,
                         before_update=lambda s: norms.append(grad_norms(model)))
    radius = float(torch.linalg.eigvals(model.rnn.weight_hh_l0.detach()).abs().max())
    return _rnn_init_oracle(model, ref, x0, y0, norms, losses, spectral_radius=[3.0, radius], seq_len=20)


@scenario("fresh3_irnn_two_layer_identity_gain2_explodes", "rnn", "exploding_gradients", "init",
          "Le, Jaitly & Hinton 2015, 'A Simple Way to Initialize Recurrent Networks of Rectified Linear Units' "
          "(IRNN: recurrent weights = identity, biases 0) with the identity scaled by 2 instead of 1: a "
          "two-layer ReLU RNN doubles its state each time step, and the adding problem's loss and gradients "
          "explode from the first step in both layers", fresh=True)
def fresh3_irnn_two_layer_identity_gain2_explodes(run_dir: str) -> Oracle:
    g = seed_all(606)
    task = _adding_problem(g, 16)
    x0, y0 = task(0)
    model, ref = _ReLURNN(layers=2), _ReLURNN(layers=2)

    def irnn(net, gain):
        with torch.no_grad():
            for k in range(2):
                getattr(net.rnn, f"weight_hh_l{k}").copy_(gain * torch.eye(64))
                getattr(net.rnn, f"bias_hh_l{k}").zero_()
                getattr(net.rnn, f"bias_ih_l{k}").zero_()

    irnn(model, 2.0)  # the bug
    ref.load_state_dict(model.state_dict())
    irnn(ref, 1.0)  # the reference: the IRNN as published
    norms: list[dict] = []
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    losses = record_loop(model, run_dir, lambda s: (x0, y0) if s == 0 else task(s), 120, opt, F.mse_loss,
                         clip=None, before_update=lambda s: norms.append(grad_norms(model)))
    return _rnn_init_oracle(model, ref, x0, y0, norms, losses, identity_gain=2.0, seq_len=16, layers=2)


# -- a learning rate far too high from the first step --------------------------------------------

@scenario("fresh3_distilbert_adamw_lr1_explodes", "distilbert", "exploding_gradients", "init",
          "AdamW at lr 1.0, ~1000x a usual lr for a small Transformer (1e-3; BERT fine-tuning: 2e-5 to 5e-5, "
          "Devlin et al. 2019): the first update moves every weight by ~lr, the next step's loss and gradient "
          "norms jump by orders of magnitude, then the loss falls back to chance level (Wortsman et al. 2023, "
          "'Small-scale proxies for large-scale Transformer training instabilities', on lr sensitivity)",
          fresh=True)
def fresh3_distilbert_adamw_lr1_explodes(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(607)
    V, T = 64, 32

    def batch(step):  # label: more "low" tokens (5..33) than "high" ones (34..63)
        ids = torch.randint(5, V, (32, T), generator=g)
        ids[:, 0] = 1
        return {"input_ids": ids, "labels": (((ids >= 5) & (ids < 34)).sum(1) > (ids >= 34).sum(1)).long()}, None

    model = tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=T, num_labels=2))
    norms: list[dict] = []
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.01)  # the bug
    losses = record_loop(model, run_dir, batch, 100, opt, before_update=lambda s: norms.append(grad_norms(model)))
    # The oracle (p.grad, the loss): the total gradient norm over 100x its step-0 value within the
    # first 3 steps; the loss over 10x its first value within them, then falling back (last 10
    # steps under 1/10 of that peak). where: the parameters whose own gradient norm at the onset
    # is over 100x their own at step 0 (most of them: every layer alike).
    total = [_total(n) for n in norms]
    onset = next((s for s, t in enumerate(total) if t > 100 * total[0]), None)
    assert all(map(math.isfinite, total + losses)), "non-finite"
    assert onset is not None and onset <= 3, total[:10]
    peak = max(losses[:4])
    assert peak > 10 * losses[0] and sum(losses[-10:]) / 10 < 0.1 * peak, (losses[:10], losses[-10:])
    # (parameters whose step-0 gradient is structurally ~0, e.g. an attention key's bias, to which
    # softmax is invariant, left out)
    growth = {p: norms[onset][p] / norms[0][p] for p in norms[0] if norms[0][p] > 1e-6 * total[0]}
    where = sorted((p for p in growth if growth[p] > 100), key=lambda p: -growth[p])
    assert len(where) > 0.5 * len(growth), growth
    return Oracle("exploding_gradients", step=onset, where=where, step_tolerance=2,
                  evidence={"lr": 1.0, "total_grad_norm_first10": total[:10],
                            "onset_over_step0": total[onset] / total[0],
                            "median_over_step0": statistics.median(total) / total[0],
                            "growth_of_where": {p: growth[p] for p in where}, "loss_first10": losses[:10],
                            "loss_last10": sum(losses[-10:]) / 10})


# -- slow memory leaks ---------------------------------------------------------------------------

def _slope(ys: list[float]) -> float:
    """Least-squares slope of ys against their index."""
    n, mx, my = len(ys), (len(ys) - 1) / 2, sum(ys) / len(ys)
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def _hook_leak(run_dir, model, module, start, steps, batch, opt, min_growth):
    """Train; from step `start` on, a forward hook on `module` appends its output (graph and all)
    to a list that is never cleared. The oracle: resident memory (/proc, read after every step)
    about flat before `start` (least-squares slope over steps 20..start under 1/5 of the slope
    after it), growing from it at over half the kept output's size per step, > min_growth MiB."""
    kept, now, rss = [], {"step": 0}, []
    model.get_submodule(module).register_forward_hook(
        lambda m, a, out: kept.append(out) if now["step"] >= start else None)

    def feed(step):
        now["step"] = step
        return batch(step)

    losses = record_loop(model, run_dir, feed, steps, opt, after_step=lambda s, l: rss.append(rss_mib()))
    per_step = kept[0].numel() * kept[0].element_size() / 2**20
    before, after = _slope(rss[20:start]), _slope(rss[start:])
    assert len(kept) == steps - start and kept[0].grad_fn is not None
    assert after > 0.5 * per_step and before < 0.2 * after and rss[-1] - rss[start] > min_growth, \
        (before, after, per_step, rss[::10])
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < sum(losses[:20]), losses[::20]
    return Oracle("memory_leak", step=start, where=[module], step_tolerance=50,
                  evidence={"kept_mib_per_step": per_step, "rss_mib_per_step_before": before,
                            "rss_mib_per_step_after": after, "rss_at_start": rss[start], "rss_at_end": rss[-1],
                            "loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20})


@scenario("fresh3_convnext_feature_map_logger_leak", "convnext", "memory_leak", "mid",
          "a feature-map logger (for TensorBoard image summaries) registered at step 50 appends the first "
          "ConvNeXt stage's output to a list to be written at the end of the epoch, without .detach().cpu() "
          "(PyTorch FAQ: 'Don't accumulate history across your training loop'); ~1 MiB kept per step "
          "(Liu et al. 2022, ConvNeXt)", fresh=True)
def fresh3_convnext_feature_map_logger_leak(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(608)
    model = tf.ConvNextForImageClassification(tf.ConvNextConfig(
        num_channels=3, patch_size=2, hidden_sizes=[32, 64, 128], depths=[1, 1, 1], num_stages=3, num_labels=8,
        image_size=32))
    sample = image_templates(g, 32)

    def batch(step):
        x, y = sample(32, 2.0)
        return {"pixel_values": x, "labels": y}, None

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return _hook_leak(run_dir, model, "convnext.encoder.stages.0", 50, 160, batch, opt, 100)


@scenario("fresh3_regnet_stem_histogram_small_leak", "regnet", "memory_leak", "mid",
          "an activation-histogram monitor registered at step 60 keeps the RegNet stem's output every step in "
          "a list for an end-of-epoch histogram and never clears it (PyTorch FAQ, 'My model reports out of "
          "memory': don't accumulate history); a small leak, 0.5 MiB per step (Radosavovic et al. 2020, RegNet)",
          fresh=True)
def fresh3_regnet_stem_histogram_small_leak(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(609)
    model = tf.RegNetForImageClassification(tf.RegNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1], groups_width=8,
        layer_type="x", num_labels=8))
    sample = image_templates(g, 32)

    def batch(step):
        x, y = sample(32, 2.0)
        return {"pixel_values": x, "labels": y}, None

    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-5)
    return _hook_leak(run_dir, model, "regnet.embedder", 60, 260, batch, opt, 40)
