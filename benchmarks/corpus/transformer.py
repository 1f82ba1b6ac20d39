"""Transformer scenarios (family "transformer"): nn.TransformerEncoder / nn.TransformerEncoderLayer
and nn.MultiheadAttention on synthetic token tasks, with padding masks or causal masks.

Tasks (generated here, seeded):
- counting: variable-length sequences (padded) of tokens; the label is whether token 1 occurs
  more often than token 2. The answer depends on every position, so healthy attention stays
  broad; a one-hot attention is a pathology here, not a solution;
- a causal language model on a random Markov chain (next-token prediction).

The attention oracle is a separate no_grad probe on a fixed batch: each layer's own
nn.MultiheadAttention is called with need_weights=True, average_attn_weights=False on exactly
the input it gets in the model, and the normalised entropy of each row is taken over the keys
that row may attend to (padding and causal masks; base.attention_entropy's `valid`).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, attention_entropy, grad_norms, record_loop, scenario, seed_all

FAMILY = "transformer"
VOCAB, PAD = 12, 0  # token 0 is padding


def _count_task(g: torch.Generator, batch: int = 32, max_len: int = 16, min_len: int = 6):
    """(tokens (B, L), padding mask (B, L) True = padding), label: #1 > #2 among real tokens."""

    def make(step: int, empty_rows: int = 0):
        lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
        if empty_rows:
            lengths[:empty_rows] = 0
        tokens = torch.randint(1, VOCAB, (batch, max_len), generator=g)
        pad = torch.arange(max_len)[None] >= lengths[:, None]
        tokens = tokens.masked_fill(pad, PAD)
        y = ((tokens == 1).sum(1) > (tokens == 2).sum(1)).long()
        return (tokens, pad), y

    return make


class Encoder(nn.Module):
    """Token + learned position embeddings, an nn.TransformerEncoder, masked mean pooling, a head."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, ff: int = 64, dropout: float = 0.0,
                 norm_first: bool = False, max_len: int = 16, n_out: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=dropout, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_out)

    def embed_tokens(self, tokens):
        return self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))[None]

    def forward(self, tokens, pad):
        h = self.encoder(self.embed_tokens(tokens), src_key_padding_mask=pad)
        keep = (~pad)[..., None].to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp_min(1.0))


def probe_attention(model: Encoder, tokens, pad, causal: torch.Tensor | None = None) -> dict[str, float]:
    """Each layer's mean normalised attention entropy on this batch (self_attn name -> value):
    the layer's own MultiheadAttention with need_weights=True on the very input it receives
    (norm1 of it for pre-LN), rows of padding queries left out, keys limited to the allowed ones."""
    was = model.training
    model.eval()
    out = {}
    with torch.no_grad():
        h = model.embed_tokens(tokens)
        L = tokens.shape[1]
        allowed = ~pad[:, None, None, :].expand(-1, 1, L, L)  # (B, 1, Lq, Lk)
        if causal is not None:
            allowed = allowed & ~causal[None, None]
        allowed = allowed & ~pad[:, None, :, None]  # padding queries: no row
        for i, layer in enumerate(model.encoder.layers):
            a = layer.norm1(h) if layer.norm_first else h
            _, w = layer.self_attn(a, a, a, key_padding_mask=pad, attn_mask=causal, need_weights=True,
                                   average_attn_weights=False)
            out[f"encoder.layers.{i}.self_attn"] = attention_entropy(w.nan_to_num(0.0), allowed.expand_as(w))
            h = layer(h, src_mask=causal, src_key_padding_mask=pad)
    model.train(was)
    return out


def _causal(n: int) -> torch.Tensor:
    """Bool mask, True = may NOT attend (a key after the query)."""
    return torch.triu(torch.ones(n, n, dtype=torch.bool), 1)


class CausalLM(Encoder):
    """A decoder-only language model: the Encoder's stack under a causal mask and a padding mask,
    a vocabulary head at every position."""

    def __init__(self, **kw):
        super().__init__(n_out=VOCAB, **kw)

    def forward(self, tokens, pad):
        causal = _causal(tokens.shape[1])
        h = self.encoder(self.embed_tokens(tokens), mask=causal, src_key_padding_mask=pad, is_causal=True)
        return self.head(h)


def _markov_lm_task(g: torch.Generator, batch: int = 32, max_len: int = 16, min_len: int = 4, sharp: float = 2.0):
    """Right-padded sequences from a random Markov chain over tokens 1..VOCAB-1; targets are the
    next tokens, -100 (ignored) where there is none."""
    trans = torch.softmax(sharp * torch.randn(VOCAB - 1, VOCAB - 1, generator=g), -1)

    def make(step: int, lengths: torch.Tensor | None = None):
        if lengths is None:
            lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
        seq = torch.empty(batch, max_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(1, VOCAB, (batch,), generator=g)
        for t in range(max_len):
            seq[:, t + 1] = 1 + torch.multinomial(trans[seq[:, t] - 1], 1, generator=g)[:, 0]
        pos = torch.arange(max_len)[None]
        pad = pos >= lengths[:, None]
        tokens = seq[:, :-1].masked_fill(pad, PAD)
        targets = seq[:, 1:].masked_fill(pos >= (lengths[:, None] - 1), -100)  # no target past the end
        return (tokens, pad), targets

    return make


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


class _Step:
    """The step number the next forward pass belongs to (after_step moves it on)."""

    def __init__(self):
        self.now = 0

    def after(self, step, loss):
        self.now = step + 1


COLLAPSED = 0.2  # the collapse definition: mean normalised row entropy below 0.2 (rows near one-hot)


# -- attention collapse --------------------------------------------------------------------------

@scenario("transformer_attention_collapse_qk_init", FAMILY, "attention_collapse", "init",
          "Zhai et al. 2023, 'Stabilizing Transformer Training by Preventing Attention Entropy "
          "Collapse': query/key projections 30x too large make every attention row one-hot from init")
def transformer_attention_collapse_qk_init(run_dir: str) -> Oracle:
    g = seed_all(21)
    task = _count_task(g)
    probe = task(-1)[0]
    model = Encoder()
    healthy = probe_attention(model, *probe)  # the same weights before the bad scaling
    d = model.embed.embedding_dim
    with torch.no_grad():
        for layer in model.encoder.layers:
            layer.self_attn.in_proj_weight[:2 * d] *= 30.0  # query and key rows
    ent = {0: probe_attention(model, *probe)}
    clock = _Step()

    def after(step, loss):
        clock.after(step, loss)
        if (step + 1) % 10 == 0:
            ent[step + 1] = probe_attention(model, *probe)  # the weights step+1's forward uses

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, task, 150, opt, F.cross_entropy, after_step=after)
    # The oracle: the first probed step at which a layer's mean normalised entropy is below
    # COLLAPSED (0.2), on the fixed probe batch; the same model before the scaling is near 1.
    where = sorted(n for n, v in ent[0].items() if v < COLLAPSED)
    collapsed_share = sum(all(e[n] < COLLAPSED for n in where) for e in ent.values()) / len(ent)
    assert len(where) == 2 and min(healthy.values()) > 0.8 and collapsed_share > 0.9, (ent[0], healthy, collapsed_share)
    assert all(map(math.isfinite, losses))
    return Oracle("attention_collapse", step=0, where=where, step_tolerance=10,
                  evidence={"qk_scale": 30.0, "entropy_step0": ent[0], "entropy_same_init_unscaled": healthy,
                            "entropy_last_probe": ent[max(ent)], "share_of_probes_collapsed": collapsed_share,
                            "loss_first": losses[0], "loss_last": losses[-1]})


@scenario("transformer_attention_collapse_lr_jump", FAMILY, "attention_collapse", "mid",
          "Zhai et al. 2023 (attention entropy collapse accompanies high-learning-rate instability in "
          "post-LN Transformers): Adam's lr raised 100x (1e-3 -> 0.1) at step 60")
def transformer_attention_collapse_lr_jump(run_dir: str) -> Oracle:
    g = seed_all(20)
    task = _count_task(g)
    probe = task(-1)[0]
    model = Encoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    jump = 60  # inside the first 100 steps, where the recorder watches every 10th step
    ent = {0: probe_attention(model, *probe)}

    def look(step):
        if step == jump:
            for pg in opt.param_groups:
                pg["lr"] = 0.1  # from the update of step `jump` on

    def after(step, loss):
        if step + 1 >= jump - 10 or (step + 1) % 10 == 0:
            ent[step + 1] = probe_attention(model, *probe)  # the weights step+1's forward uses

    losses = record_loop(model, run_dir, task, 160, opt, F.cross_entropy, before_update=look, after_step=after)
    # The oracle: the first step whose forward uses weights with a layer's mean normalised
    # entropy (probe batch) below COLLAPSED (0.2), every probe before the jump above 0.7.
    pre = [v for s, e in ent.items() if s <= jump for v in e.values()]
    step = next((s for s in sorted(ent) if min(ent[s].values()) < COLLAPSED), None)
    assert step is not None and step > jump and min(pre) > 0.7, (step, min(pre))
    where = sorted(n for n, v in ent[step].items() if v < COLLAPSED)
    stays = all(all(ent[s][n] < COLLAPSED for n in where) for s in ent if s >= step + 10)
    assert stays, {s: ent[s] for s in sorted(ent) if s >= step}
    assert sum(losses[jump - 20:jump]) < 0.6 * sum(losses[:20]), losses[::10]  # it had learnt
    return Oracle("attention_collapse", step=step, where=where, step_tolerance=10,
                  evidence={"lr_jump_step": jump, "lr": [1e-3, 0.1], "entropy_before_jump": ent[jump],
                            "entropy_at_step": ent[step], "entropy_last": ent[max(ent)],
                            "loss_before_jump20": sum(losses[jump - 20:jump]) / 20,
                            "loss_last20": sum(losses[-20:]) / 20})


# -- non-finite values ---------------------------------------------------------------------------

@scenario("transformer_nonfinite_fully_masked_attention_pooling", FAMILY, "nonfinite", "mid",
          "nn.MultiheadAttention returns NaN when key_padding_mask masks every key of a sequence "
          "(softmax over all -inf; PyTorch issues #40932, #41508): attention pooling meets an "
          "empty record at step 60")
def transformer_nonfinite_fully_masked_attention_pooling(run_dir: str) -> Oracle:
    g = seed_all(23)
    task = _count_task(g)

    class PooledEncoder(Encoder):
        """Attention pooling: one learned query attends over the encoder's outputs (the
        MultiheadAttention's default need_weights=True path, a softmax over the masked keys)."""

        def __init__(self):
            super().__init__()
            self.query = nn.Parameter(torch.randn(1, 1, 32) * 0.1)
            self.pool = nn.MultiheadAttention(32, 2, batch_first=True)

        def forward(self, tokens, pad):
            h = self.encoder(self.embed_tokens(tokens), src_key_padding_mask=pad)
            pooled, _ = self.pool(self.query.expand(h.shape[0], -1, -1), h, h, key_padding_mask=pad)
            return self.head(pooled[:, 0])

    bad_step = 60
    model = PooledEncoder()
    clock = _Step()
    born = {}

    def hook(name):
        def fn(module, args, out):
            o = out[0] if isinstance(out, tuple) else out
            ins = [a for a in args if torch.is_tensor(a) and a.is_floating_point()]
            if torch.is_grad_enabled() and name not in born and not torch.isfinite(o).all() \
                    and all(torch.isfinite(a).all() for a in ins):
                born[name] = clock.now
        return fn

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(hook(name))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, lambda s: task(s, empty_rows=1 if s == bad_step else 0), 90, opt,
                         F.cross_entropy, after_step=clock.after)
    # The oracle: the first step at which a module's output holds NaN while its inputs are
    # finite (our forward hooks on every module): the pooling attention, at the empty record.
    first = min(born.values()) if born else None
    where = sorted(n for n, s in born.items() if s == first)
    assert first == bad_step and where == ["pool"] and all(map(math.isfinite, losses[:bad_step])), (born, losses[bad_step])
    return Oracle("nonfinite", step=first, where=where, step_tolerance=0,
                  evidence={"empty_record_step": bad_step, "born_in": born, "loss_at_step": losses[bad_step]})


@scenario("transformer_nonfinite_loss_all_targets_ignored", FAMILY, "nonfinite", "mid",
          "F.cross_entropy with ignore_index and mean reduction is 0/0 = NaN when every target of "
          "the batch is ignored (PyTorch issues #70348, #75181: intended since PR #64572): a causal LM's batch of one-token documents "
          "at step 50; the model's outputs are finite, the NaN is born in the loss")
def transformer_nonfinite_loss_all_targets_ignored(run_dir: str) -> Oracle:
    g = seed_all(24)
    task = _markov_lm_task(g)
    bad_step = 50
    model = CausalLM()
    clock = _Step()
    outputs_finite = {}

    def hook(module, args, out):
        if torch.is_grad_enabled():
            outputs_finite[clock.now] = outputs_finite.get(clock.now, True) and bool(torch.isfinite(out).all())

    for m in model.modules():
        if not isinstance(m, nn.MultiheadAttention):  # (its output is a tuple; what it feeds is checked)
            m.register_forward_hook(hook)
    grads_finite = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir,
                         lambda s: task(s, torch.ones(32, dtype=torch.long) if s == bad_step else None), 80, opt,
                         _lm_loss, after_step=clock.after,
                         before_update=lambda s: grads_finite.append(all(map(math.isfinite, grad_norms(model).values()))))
    # The oracle: the first step whose loss is non-finite; at that step every module's output
    # was finite (our hooks) and every gradient finite (zeros): it was born in the loss, which
    # no module of the model computes (where: none to name).
    step = first = next((s for s, l in enumerate(losses) if not math.isfinite(l)), None)
    assert step == bad_step and outputs_finite[step] and grads_finite[step] and math.isnan(losses[step]), \
        (first, outputs_finite.get(step))
    assert all(math.isfinite(l) for s, l in enumerate(losses) if s != bad_step)
    return Oracle("nonfinite", step=step, where=[], step_tolerance=0,
                  evidence={"bad_batch_step": bad_step, "loss_at_step": losses[step], "model_outputs_finite": True,
                            "grads_finite_at_step": grads_finite[step], "born_in": "the loss (0/0 mean over no targets)"})


@scenario("transformer_nonfinite_log_of_softmax_lr_jump", FAMILY, "nonfinite", "mid",
          "log(softmax(x)) instead of log_softmax (PyTorch docs of nn.LogSoftmax / nn.NLLLoss): once "
          "a logit gap exceeds ~104 a probability underflows to 0 in float32 and its log is -inf; "
          "the gap grows after SGD's lr is raised 100x (0.1 -> 10) at step 80")
def transformer_nonfinite_log_of_softmax_lr_jump(run_dir: str) -> Oracle:
    g = seed_all(25)
    task = _markov_lm_task(g)

    class LogOfSoftmax(nn.Module):  # a weightless module, the naive way
        def forward(self, x):
            return torch.log(torch.softmax(x, -1))

    class LM(CausalLM):
        def __init__(self):
            super().__init__()
            self.logprob = LogOfSoftmax()

        def forward(self, tokens, pad):
            return self.logprob(super().forward(tokens, pad))

    model = LM()
    jump = 80
    clock = _Step()
    born = {}

    def hook(name):
        def fn(module, args, out):
            o = out[0] if isinstance(out, tuple) else out
            ins = [a for a in args if torch.is_tensor(a) and a.is_floating_point()]
            if torch.is_grad_enabled() and name not in born and not torch.isfinite(o).all() \
                    and all(torch.isfinite(a).all() for a in ins):
                born[name] = dict(step=clock.now, neg_inf=bool(torch.isneginf(o).any()),
                                  max_gap=float((ins[0].amax(-1) - ins[0].amin(-1)).max()) if ins else None)
        return fn

    for name, m in model.named_modules():
        if name:
            m.register_forward_hook(hook(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def look(step):
        if step == jump:
            for pg in opt.param_groups:
                pg["lr"] = 10.0

    losses = record_loop(model, run_dir, task, 120, opt,
                         lambda lp, t: F.nll_loss(lp.reshape(-1, VOCAB), t.reshape(-1), ignore_index=-100),
                         before_update=look, after_step=clock.after)
    # The oracle: the first step at which a module's output holds a non-finite value while its
    # inputs are finite (our hooks on every module): LogOfSoftmax's -inf, its input (the
    # logits) finite.
    first = min(b["step"] for b in born.values()) if born else None
    where = sorted(n for n, b in born.items() if b["step"] == first)
    assert first is not None and first > jump and where == ["logprob"] and born["logprob"]["neg_inf"] \
        and all(map(math.isfinite, losses[:first])), (born, losses[::10])
    return Oracle("nonfinite", step=first, where=where, step_tolerance=0,
                  evidence={"lr_jump_step": jump, "lr": [0.1, 10.0], "first_neg_inf_step": first,
                            "max_logit_gap_then": born["logprob"]["max_gap"], "loss_at_step": losses[first],
                            "loss_before_jump": losses[jump - 1]})


# -- healthy controls ----------------------------------------------------------------------------

def _healthy_grad_bound(total: list[float]) -> None:
    assert all(map(math.isfinite, total)) and max(total) < 20 * statistics.median(total), \
        (max(total), statistics.median(total))


@scenario("transformer_healthy_preln_adamw_cosine", FAMILY, None, "healthy",
          "the usual recipe: pre-LN Transformer encoder (Xiong et al. 2020), dropout 0.1, AdamW, "
          "linear warm-up then cosine decay (Loshchilov & Hutter 2019), padding masks")
def transformer_healthy_preln_adamw_cosine(run_dir: str) -> Oracle:
    g = seed_all(22)
    task = _count_task(g)
    probe = task(-1)[0]
    model = Encoder(dropout=0.1, norm_first=True)
    steps, warm = 300, 30
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    ent, total = {0: probe_attention(model, *probe)}, []

    def after(step, loss):
        if (step + 1) % 20 == 0:
            ent[step + 1] = probe_attention(model, *probe)

    losses = record_loop(model, run_dir, task, steps, opt, F.cross_entropy, scheduler=sched, after_step=after,
                         before_update=lambda s: total.append(math.sqrt(sum(v * v for v in grad_norms(model).values()))))
    # The oracle of health: the loss falls clearly, everything finite, gradient norms bounded,
    # and no layer's attention anywhere near collapse (normalised entropy above 0.5 throughout).
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.2 * sum(losses[:20]), losses[::20]
    _healthy_grad_bound(total)
    low = min(v for e in ent.values() for v in e.values())
    assert low > 0.5, ent
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "min_entropy": low, "entropy_last": ent[max(ent)],
                                  "grad_norm_median": statistics.median(total), "grad_norm_max": max(total)})


@scenario("transformer_healthy_causal_lm_warmup", FAMILY, None, "healthy",
          "a small decoder-only LM (causal + padding masks), post-LN, AdamW with linear warm-up "
          "(Vaswani et al. 2017; Popel & Bojar 2018 on warm-up)")
def transformer_healthy_causal_lm_warmup(run_dir: str) -> Oracle:
    g = seed_all(26)
    task = _markov_lm_task(g)
    probe_tokens, probe_pad = task(-1)[0]
    causal = _causal(probe_tokens.shape[1])
    model = CausalLM(dropout=0.1)
    warm = 40
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    ent, total = {0: probe_attention(model, probe_tokens, probe_pad, causal)}, []

    def after(step, loss):
        if (step + 1) % 20 == 0:
            ent[step + 1] = probe_attention(model, probe_tokens, probe_pad, causal)

    losses = record_loop(model, run_dir, task, 200, opt, _lm_loss, scheduler=sched, after_step=after,
                         before_update=lambda s: total.append(math.sqrt(sum(v * v for v in grad_norms(model).values()))))
    # The oracle of health: the loss falls clearly toward the chain's entropy, all finite,
    # gradient norms bounded, attention entropy (over the keys the causal and padding masks
    # allow) above 0.5 throughout.
    assert all(map(math.isfinite, losses)) and sum(losses[-20:]) < 0.75 * sum(losses[:20]), losses[::20]
    _healthy_grad_bound(total)
    low = min(v for e in ent.values() for v in e.values())
    assert low > 0.5, ent
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "min_entropy": low, "entropy_last": ent[max(ent)],
                                  "grad_norm_median": statistics.median(total), "grad_norm_max": max(total)})
