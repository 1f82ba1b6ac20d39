"""Fresh scenarios of attention collapse, memory leaks and healthy controls (split "fresh": written
after the thresholds were tuned, held out from all tuning). Each is a short real training run
recorded by the default Recorder; the oracle is the scenario's own measurement: attention
probabilities the model's own attention modules return (need_weights / output_attentions) on a
probe batch, resident memory (/proc), the loss and p.grad."""

from __future__ import annotations

import copy
import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, attention_entropy, grad_norms, hf, image_templates, record_loop, rss_mib, scenario, seed_all


# -- shared helpers ------------------------------------------------------------------------------

def _total(model: nn.Module) -> float:
    return math.sqrt(sum(v * v for v in grad_norms(model).values()))


def _collapse_onset(history: dict[int, list[float]], names: list[str], after: int, threshold: float = 0.1):
    """First probed step > `after` at which some layer's mean normalised entropy is below the
    threshold; where = the layers whose median entropy over the probes from there on is below it."""
    steps = sorted(history)
    onset = next((s for s in steps if s > after and min(history[s]) < threshold), None)
    assert onset is not None, {s: history[s] for s in steps[::5]}
    later = [history[s] for s in steps if s >= onset]
    med = [statistics.median(e[i] for e in later) for i in range(len(names))]
    return onset, [n for n, m in zip(names, med) if m < threshold], med


def _leak_oracle(rss: list[float], start: int, per_step: float, where: list[str], losses: list[float]) -> Oracle:
    """Resident memory (/proc, read after every step) about flat before `start` (growth per step
    from step 20, after the allocator's warm-up, under 1/5 of the growth after it) and growing from
    it by at least half of what is kept each step (`per_step` MiB), > 100 MiB in all."""
    before = (rss[start - 1] - rss[20]) / (start - 1 - 20)
    after = (rss[-1] - rss[start]) / (len(rss) - 1 - start)
    assert after > 0.5 * per_step and before < 0.2 * after and rss[-1] - rss[start] > 100, (before, after, per_step)
    assert all(map(math.isfinite, losses))
    return Oracle("memory_leak", step=start, where=where, step_tolerance=50,
                  evidence={"kept_mib_per_step": per_step, "rss_mib_per_step_before": before,
                            "rss_mib_per_step_after": after, "rss_at_start": rss[start], "rss_at_end": rss[-1],
                            "loss_first": losses[0], "loss_last": losses[-1]})


# -- attention collapse ---------------------------------------------------------------------------

@scenario("fresh_transformer_raw_sensor_units_attention_collapse", "transformer", "attention_collapse", "mid",
          "attention logits grow with the square of the input's scale where no LayerNorm precedes the "
          "attention (Post-LN: Xiong et al. 2020), and softmax rows go one-hot (entropy collapse, Zhai et al. "
          "2023); a data-pipeline change at step 120 stops standardising a sensor time series (raw units, "
          "offset 500, x100) fed to a Post-LN nn.TransformerEncoder", fresh=True)
def fresh_transformer_raw_sensor_units_attention_collapse(run_dir: str) -> Oracle:
    g = seed_all(510)
    length, n_feat, d, change, steps = 24, 4, 32, 120, 220
    t = torch.arange(length).float()

    def standardised(n):  # 4-channel noisy sines; class 1 has a larger amplitude than class 0
        y = torch.randint(0, 2, (n,), generator=g)
        freq = 0.5 * (1 + 0.2 * torch.rand(n, 1, n_feat, generator=g))
        phase = 2 * math.pi * torch.rand(n, 1, n_feat, generator=g)
        amp = (0.6 + 0.8 * y.float())[:, None, None]
        return amp * torch.sin(freq * t[None, :, None] + phase) + 0.8 * torch.randn(n, length, n_feat, generator=g), y

    def pipeline(x, step):  # the bug: from step `change` on, the standardisation is skipped
        return 500.0 + 100.0 * x if step >= change else x

    class SensorTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(n_feat, d)
            self.pos = nn.Parameter(0.02 * torch.randn(length, d))
            layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)  # Post-LN (the default)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, 2)

        def embed(self, x):
            return self.inp(x) + self.pos[None]

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)).mean(1))

    model = SensorTransformer()
    twin = copy.deepcopy(model).eval()  # the probe runs on a copy: the recorded model runs no extra forward
    names = [f"encoder.layers.{i}.self_attn" for i in range(2)]

    def probe(x):
        """Each layer's MultiheadAttention (current weights), need_weights=True, on exactly its input."""
        twin.load_state_dict(model.state_dict())
        out = []
        with torch.no_grad():
            h = twin.embed(x)
            for layer in twin.encoder.layers:
                _, w = layer.self_attn(h, h, h, need_weights=True, average_attn_weights=False)
                out.append(attention_entropy(w))
                h = layer(h)
        return out

    probe_x, _ = standardised(16)  # the probe's records go through the same pipeline as the training batches
    seen, clean = {}, {}

    def batch(step):  # probes before the step's forward: what that forward's attention sees
        seen[step] = probe(pipeline(probe_x, step))
        if step % 10 == 0:
            clean[step] = probe(probe_x)
        x, y = standardised(32)
        return pipeline(x, step), y

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, batch, steps, opt, F.cross_entropy)
    # The oracle: the first step at which a layer's mean normalised attention entropy on the probe
    # batch (as the pipeline delivers it) is below 0.1; where = the layers whose median entropy from
    # there on is below 0.1. Before it every layer is above 0.5 and the model has learnt.
    onset, where, med = _collapse_onset(seen, names, 0)
    before = min(min(seen[s]) for s in range(change))
    assert onset == change and where == names[:1] and before > 0.5, (onset, where, before)
    assert sum(losses[change - 20:change]) < 0.5 * sum(losses[:20]) and all(map(math.isfinite, losses)), losses[::10]
    # On standardised records the same weights still attend broadly: the data, not the weights.
    assert min(min(e) for e in clean.values()) > 0.5, clean
    return Oracle("attention_collapse", step=onset, where=where, step_tolerance=10,
                  evidence={"pipeline_change_step": change, "min_entropy_before": before,
                            "entropy_at_onset": seen[onset], "median_entropy_after": med,
                            "entropy_standardised_probe_last": clean[max(clean)],
                            "loss_before_change": sum(losses[change - 20:change]) / 20,
                            "loss_last20": sum(losses[-20:]) / 20})


class _SwitchOptimizer:
    """Delegates to the optimizer in use (`cur`); a two-stage recipe swaps it at a stage boundary."""

    def __init__(self, opt):
        self.cur = opt

    def zero_grad(self, set_to_none: bool = True):
        self.cur.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.cur.step()


@scenario("fresh_vit_sgd_to_adamw_keeps_lr_attention_collapse", "vit", "attention_collapse", "mid",
          "a two-stage recipe switches from SGD (lr 0.1) to AdamW at step 120 but keeps SGD's lr, ~100x what "
          "Adam wants (Wilson et al. 2017 and Keskar & Socher 2017 on switching between SGD and Adam; "
          "attention entropy collapse at a too-high Adam lr: Zhai et al. 2023; Dehghani et al. 2023)",
          fresh=True)
def fresh_vit_sgd_to_adamw_keeps_lr_attention_collapse(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(511)
    change, steps = 120, 220

    def vit(impl):
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, num_labels=8, attn_implementation=impl))

    model = vit("sdpa")
    twin = vit("eager").eval()  # the probe: an eager copy with the current weights (no extra forward of the model)
    sample = image_templates(g, 16)
    probe_x, _ = sample(16, 1.5)
    names = [f"vit.layers.{i}.attention" for i in range(2)]
    history, max_w = {}, {}

    def batch(step):
        if step % 5 == 0 or change - 3 <= step <= change + 30:
            twin.load_state_dict(model.state_dict())
            with torch.no_grad():
                att = twin(pixel_values=probe_x, output_attentions=True).attentions
            history[step] = [attention_entropy(a) for a in att]
            max_w[step] = [float(a.amax(-1).mean()) for a in att]
        x, y = sample(32, 1.5)
        return {"pixel_values": x, "labels": y}, None

    opt = _SwitchOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))

    def before_update(step):
        if step == change:  # stage 2: AdamW, with the lr of stage 1 (the bug)
            opt.cur = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=1e-4)

    losses = record_loop(model, run_dir, batch, steps, opt, before_update=before_update)
    # The oracle: the first probed step (its forward's weights) at which a layer's mean normalised
    # attention entropy on the probe batch is below 0.1; where = the layers whose median entropy
    # from there on is below 0.1. Before the switch every layer is above 0.5 and the model learns.
    onset, where, med = _collapse_onset(history, names, change)
    before = min(min(history[s]) for s in history if s <= change)
    assert before > 0.5 and where, (before, where, med)
    assert sum(losses[change - 20:change]) < 0.5 * sum(losses[:20]) and all(map(math.isfinite, losses)), losses[::10]
    return Oracle("attention_collapse", step=onset, where=where, step_tolerance=10,
                  evidence={"switch_step": change, "lr": 0.1, "min_entropy_before_switch": before,
                            "entropy_at_onset": history[onset], "mean_max_weight_at_onset": max_w[onset],
                            "median_entropy_after_onset": med, "entropy_last": history[max(history)],
                            "loss_before_switch": sum(losses[change - 20:change]) / 20,
                            "loss_last20": sum(losses[-20:]) / 20})


# -- memory leaks --------------------------------------------------------------------------------

@scenario("fresh_resnet_gradient_history_dict_leak", "resnet", "memory_leak", "mid",
          "a gradient-noise monitor (McCandlish et al. 2018, 'An Empirical Model of Large-Batch Training') "
          "switched on at step 60 stores every step's p.grad tensors in a dict keyed by step instead of "
          "keeping running sums: with zero_grad(set_to_none=True) each step's gradients are new tensors, "
          "and none is freed (PyTorch FAQ, 'My model reports out of memory')", fresh=True)
def fresh_resnet_gradient_history_dict_leak(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(512)
    model = tf.ResNetForImageClassification(tf.ResNetConfig(
        num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128], depths=[1, 1, 1], layer_type="basic",
        num_labels=8))
    sample = image_templates(g, 16)
    start, steps = 60, 260
    history: dict[int, list[torch.Tensor]] = {}
    rss: list[float] = []

    def before_update(step):
        if step >= start:
            history[step] = [p.grad for p in model.parameters()]  # the bug: the tensors, not running sums

    def batch(step):
        x, y = sample(32, 3.0)
        return {"pixel_values": x, "labels": y}, None

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = record_loop(model, run_dir, batch, steps, opt, before_update=before_update,
                         after_step=lambda s, l: rss.append(rss_mib()))
    # The oracle: resident memory about flat before step 60, growing from it by about the size of
    # the kept gradients; no module's outputs are kept (where: none).
    assert len(history) == steps - start
    per_step = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return _leak_oracle(rss, start, per_step, [], losses)


@scenario("fresh_bert_attention_map_cache_leak", "bert", "memory_leak", "mid",
          "an attention-map dashboard hook (output_attentions-style visualisation) registered at step 60 keeps "
          "the first layer's self-attention outputs, graph and all, in a dict keyed by step and never clears it "
          "(PyTorch FAQ, 'My model reports out of memory': don't accumulate history across your training loop)",
          fresh=True)
def fresh_bert_attention_map_cache_leak(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(513)
    V, T = 64, 64
    model = tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=T, num_labels=2, pad_token_id=0, attn_implementation="eager"))
    module = "bert.encoder.layer.0.attention.self"
    start, steps = 60, 260
    cache: dict[int, tuple] = {}
    now = {"step": 0}
    rss: list[float] = []

    def keep(mod, args, out):  # the bug: (context, attention probabilities) kept with their graph
        cache[now["step"]] = out

    def batch(step):
        now["step"] = step
        if step == start:
            model.get_submodule(module).register_forward_hook(keep)
        ids = torch.randint(5, V, (32, T), generator=g)
        ids[:, 0] = 1
        y = (((ids >= 5) & (ids < 34)).sum(1) > (ids >= 34).sum(1)).long()
        return {"input_ids": ids, "labels": y}, None

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, steps, opt, after_step=lambda s, l: rss.append(rss_mib()))
    # The oracle: resident memory about flat before step 60, growing from it by about the size of
    # what the hook keeps (every kept output still holds its graph); where: the module it hooks.
    assert len(cache) == steps - start and all(o[0].grad_fn is not None for o in cache.values())
    per_step = sum(t.numel() * t.element_size() for t in cache[start] if torch.is_tensor(t)) / 2**20
    return _leak_oracle(rss, start, per_step, [module], losses)


# -- healthy controls ----------------------------------------------------------------------------

def _assert_healthy(losses: list[float], total: list[float], fall: float, surge: float = 10.0) -> dict:
    """Loss finite and falling (last 20 steps under `fall` x the first 20), gradient norms finite
    and never surging (after the first 20 steps, never above `surge` x the largest of those: the
    gradient norm of a converging run shrinks from its start, it does not grow)."""
    assert all(map(math.isfinite, losses + total)), "non-finite"
    assert sum(losses[-20:]) < fall * sum(losses[:20]), losses[::20]
    start, later = max(total[:20]), max(total[20:])
    assert later < surge * start, (later, start)
    return {"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
            "grad_norm_max_first20": start, "grad_norm_max_after": later,
            "grad_norm_median": statistics.median(total), "grad_norm_last": total[-1]}


@scenario("fresh_resnet_healthy_sgd_nesterov_bf16", "resnet", None, "healthy",
          "the classic ResNet recipe (He et al. 2016; Goyal et al. 2017): BatchNorm, SGD with Nesterov "
          "momentum 0.9 and weight decay 5e-4, linear warm-up then cosine decay, forward in bf16 autocast on "
          "CPU (PyTorch AMP docs)", fresh=True)
def fresh_resnet_healthy_sgd_nesterov_bf16(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(514)
    model = tf.ResNetForImageClassification(tf.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[2, 2, 2], layer_type="basic",
        num_labels=8))
    # autocast around each forward (the model's own loss included), as the AMP docs prescribe
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    sample = image_templates(g, 16)
    steps, warm = 200, 10
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    total: list[float] = []

    def batch(step):
        x, y = sample(32, 4.0)
        return {"pixel_values": x, "labels": y}, None

    losses = record_loop(model, run_dir, batch, steps, opt, scheduler=sched,
                         before_update=lambda s: total.append(_total(model)))
    return Oracle(None, evidence=_assert_healthy(losses, total, 0.5))


@scenario("fresh_rnn_healthy_lstm_lm_tied_dropout", "rnn", None, "healthy",
          "the AWD-LSTM-style recipe (Merity et al. 2018; Press & Wolf 2017 weight tying; Zaremba et al. 2014 "
          "dropout): a token-level LSTM language model with tied input/output embeddings, dropout 0.3, Adam, "
          "gradient clipping at 0.25", fresh=True)
def fresh_rnn_healthy_lstm_lm_tied_dropout(run_dir: str) -> Oracle:
    g = seed_all(515)
    vocab, d, length = 48, 64, 32
    trans = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), -1)  # a random Markov chain

    def batch(step):
        seq = torch.empty(32, length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (32,), generator=g)
        for t in range(length):
            seq[:, t + 1] = torch.multinomial(trans[seq[:, t]], 1, generator=g)[:, 0]
        return seq[:, :-1], seq[:, 1:]

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.drop = nn.Dropout(0.3)
            self.lstm = nn.LSTM(d, d, batch_first=True)
            self.decoder = nn.Linear(d, vocab)
            self.decoder.weight = self.embed.weight  # weight tying

        def forward(self, x):
            return self.decoder(self.drop(self.lstm(self.drop(self.embed(x)))[0]))

    model = LM()
    total: list[float] = []
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, batch, 250, opt,
                         lambda out, y: F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1)), clip=0.25,
                         before_update=lambda s: total.append(_total(model)))
    # Healthy: the loss falls from ~ln(48) = 3.9 towards the chain's entropy rate (~1.8).
    return Oracle(None, evidence=_assert_healthy(losses, total, 0.75))


@scenario("fresh_mlp_healthy_unnormalised_price_regression", "mlp", None, "healthy",
          "regression on unnormalised targets (house prices in k$, mean ~300, std ~70) with MSE and Adam "
          "(whose step does not scale with the gradient; Kingma & Ba 2015): the loss (~1e5) and the "
          "gradient norms (~1e4) are large in absolute terms, but the run is stable and converges (LeCun "
          "et al. 1998, 'Efficient BackProp' sec. 4.3 on target scaling)", fresh=True)
def fresh_mlp_healthy_unnormalised_price_regression(run_dir: str) -> Oracle:
    g = seed_all(516)
    n_feat = 8
    w_true = torch.randn(n_feat, generator=g)

    def batch(step):  # standardised features; the price is a smooth function of them, in k$
        x = torch.randn(64, n_feat, generator=g)
        price = 300 + 60 * (x @ w_true) / math.sqrt(n_feat) + 40 * torch.tanh(x[:, 0] * x[:, 1]) \
            + 10 * torch.randn(64, generator=g)
        return x, price[:, None]

    model = nn.Sequential(nn.Linear(n_feat, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    total: list[float] = []
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = record_loop(model, run_dir, batch, 300, opt, F.mse_loss,
                         before_update=lambda s: total.append(_total(model)))
    # Healthy: the loss starts at ~1e5 (prices squared) and falls by > 20x; gradient norms are large
    # (~1e3-1e4) but never surge and shrink as the fit improves.
    ev = _assert_healthy(losses, total, 0.05)
    assert losses[0] > 1e4 and total[0] > 100, (losses[0], total[0])
    assert statistics.median(total[-50:]) < statistics.median(total[:50]), (total[:50:10], total[-50::10])
    return Oracle(None, evidence=ev)

