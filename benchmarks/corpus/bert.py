"""BERT scenarios: a tiny transformers BERT (random init, nothing downloaded; post-LayerNorm
encoder, GELU) trained on synthetic sequences padded to a fixed length with an attention_mask.

Classification task: a [CLS] token (id 1), then L-1 tokens (L from 8 to 32) drawn from ids 5..63,
padding (id 0) after; the label says whether the sequence holds more "low" tokens (5..33) than
"high" ones (34..63) — learnable by attending over the valid tokens.

Attention oracles: the normalised entropy (base.attention_entropy) of the attention probabilities
the model itself returns (output_attentions=True), from a separate eager-attention copy loaded with
the recorded model's current weights (the recorded model never runs an extra forward; an sdpa model
is probed with eager attention), on a fixed padded probe batch, over the keys each query may attend
to (the non-padding ones). Probes are taken in batch(step), before that step's forward.
"""

from __future__ import annotations

import math

import torch

from .base import LOSS, Oracle, attention_entropy, first_step, grad_norms, record_loop, scenario, seed_all

V, T, E, LAYERS, HEADS = 64, 32, 32, 2, 2
COLLAPSED = 0.1  # a layer's attention is collapsed when its mean normalised entropy is below this (near one-hot)


def _config(impl: str, **kw):
    import transformers
    from transformers import BertConfig

    transformers.logging.set_verbosity_error()
    return BertConfig(vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      intermediate_size=2 * E, max_position_embeddings=T, num_labels=2, pad_token_id=0,
                      attn_implementation=impl, **kw)


def _classifier(impl: str, **kw):
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_config(impl, **kw))


def _padded(g: torch.Generator, b: int, min_len: int = 8):
    lengths = torch.randint(min_len, T + 1, (b,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = torch.randint(5, V, (b, T), generator=g)
    ids[:, 0] = 1
    return ids * mask, mask


def _labelled(g: torch.Generator, b: int = 32):
    ids, mask = _padded(g, b)
    low = ((ids >= 5) & (ids < 34)).sum(1)
    high = (ids >= 34).sum(1)
    return {"input_ids": ids, "attention_mask": mask, "labels": (low > high).long()}


class _Probe:
    """Per-layer normalised attention entropy of the model's current weights on a fixed padded
    batch, from an eager-attention copy (dropout off), over the non-padding keys."""

    def __init__(self, model, g: torch.Generator):
        self.model = model
        self.copy = type(model)(_config("eager"))
        self.copy.eval()
        self.ids, self.mask = _padded(g, 8)
        self.valid = self.mask[:, None, None, :].bool().expand(8, HEADS, T, T)
        self.history: dict[int, list[float]] = {}

    def __call__(self, step: int) -> list[float]:
        self.copy.load_state_dict(self.model.state_dict())
        with torch.no_grad():
            att = self.copy(input_ids=self.ids, attention_mask=self.mask, output_attentions=True).attentions
        ent = [attention_entropy(a, self.valid) for a in att]
        self.history[step] = ent
        return ent


def _global(norms: dict[str, float]) -> float:
    return math.sqrt(sum(v * v for v in norms.values() if not math.isnan(v)))


@scenario("bert_healthy_cls_weight_decay_dropout", "bert", None, "healthy",
          "the usual BERT fine-tuning recipe (Devlin et al. 2019): AdamW with weight decay 0.01, dropout 0.1, "
          "linear warm-up then decay (cosine here), gradient clipping at 1.0; padded batches, sdpa attention")
def bert_healthy_cls_weight_decay_dropout(run_dir: str) -> Oracle:
    g = seed_all(20)
    model = _classifier("sdpa", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    probe = _Probe(model, g)
    steps, warm = 300, 30
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    norms = []

    def batch(step):
        if step % 10 == 0 or step == steps - 1:
            probe(step)
        return _labelled(g), None

    losses = record_loop(model, run_dir, batch, steps, opt, clip=1.0, scheduler=sched,
                         before_update=lambda s: norms.append(_global(grad_norms(model))))
    # The oracle of health: the loss falls clearly (last 20 steps under half the first 20, from
    # chance level ln 2), every loss and gradient norm is finite, and no layer's attention is ever
    # collapsed on the probe batch (entropy always above 0.3).
    ents = [e for es in probe.history.values() for e in es]
    assert all(map(math.isfinite, losses + norms)), "non-finite"
    assert sum(losses[-20:]) < 0.5 * sum(losses[:20]), losses[::30]
    assert min(ents) > 0.3, probe.history
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "grad_norm_median": sorted(norms)[len(norms) // 2], "grad_norm_max": max(norms),
                                  "min_attention_entropy": min(ents)})


@scenario("bert_attention_collapse_qk_init", "bert", "attention_collapse", "init",
          "attention entropy collapse: attention logits so large that softmax rows are one-hot "
          "(Zhai et al. 2023, 'Stabilizing Transformer Training by Preventing Attention Entropy Collapse'); "
          "here from query and key weights initialised 60x too large; padded batches, sdpa attention")
def bert_attention_collapse_qk_init(run_dir: str) -> Oracle:
    g = seed_all(21)
    model = _classifier("sdpa")
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.self.query.weight *= 60.0
            layer.attention.self.key.weight *= 60.0
    probe = _Probe(model, g)

    def batch(step):
        if step < 10 or step % 10 == 0:
            probe(step)
        return _labelled(g), None

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = record_loop(model, run_dir, batch, 150, opt)
    # Collapse at a step: a layer's mean normalised attention entropy (over the non-padding keys)
    # on the probe batch < 0.1. step: the first probed step at which any layer is collapsed;
    # where: the layers collapsed on every probe of the run.
    steps = sorted(probe.history)
    onset = first_step([probe.history[s] for s in steps], lambda es: min(es) < COLLAPSED)
    assert onset is not None and steps[onset] == 0, probe.history
    where = [f"bert.encoder.layer.{i}.attention.self" for i in range(LAYERS)
             if all(probe.history[s][i] < COLLAPSED for s in steps)]
    assert where, probe.history
    assert all(map(math.isfinite, losses))
    return Oracle("attention_collapse", step=0, where=where, step_tolerance=10,
                  evidence={"entropy_step0": probe.history[0], "entropy_last": probe.history[steps[-1]],
                            "max_entropy_any_probe": max(max(v) for v in probe.history.values())})


@scenario("bert_attention_collapse_lr_jump", "bert", "attention_collapse", "mid",
          "attention entropy collapse at a high learning rate (Zhai et al. 2023, 'Stabilizing Transformer "
          "Training by Preventing Attention Entropy Collapse'); the AdamW lr jumps 300x (1e-3 -> 0.3) at "
          "step 150; padded batches, eager attention")
def bert_attention_collapse_lr_jump(run_dir: str) -> Oracle:
    g = seed_all(22)
    model = _classifier("eager")
    probe = _Probe(model, g)
    jump = 150
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def batch(step):
        for pg in opt.param_groups:
            pg["lr"] = 1e-3 if step < jump else 0.3
        if step % 10 == 0 or step >= jump - 5:
            probe(step)
        return _labelled(g), None

    losses = record_loop(model, run_dir, batch, 230, opt)
    # Collapse at a step: a layer's mean normalised attention entropy on the probe batch < 0.1.
    # step: the first probed step at which any layer is; where: the layers whose median entropy
    # over the probes from that step to the end is < 0.1.
    steps = sorted(probe.history)
    i = first_step([probe.history[s] for s in steps], lambda es: min(es) < COLLAPSED)
    assert i is not None, probe.history
    onset = steps[i]
    after = [probe.history[s] for s in steps if s >= onset]
    median_after = [sorted(e[l] for e in after)[len(after) // 2] for l in range(LAYERS)]
    where = [f"bert.encoder.layer.{l}.attention.self" for l in range(LAYERS) if median_after[l] < COLLAPSED]
    before = [probe.history[s] for s in steps if s < jump]
    assert onset > jump and min(min(e) for e in before) > 0.5 and where, {s: probe.history[s] for s in steps[::5]}
    return Oracle("attention_collapse", step=onset, where=where, step_tolerance=10,
                  evidence={"min_entropy_before_jump": min(min(e) for e in before),
                            "entropy_at_onset": probe.history[onset], "median_entropy_after": median_after,
                            "loss_before_jump": sum(losses[jump - 20:jump]) / 20, "loss_last20": sum(losses[-20:]) / 20})


@scenario("bert_nonfinite_huge_input_layernorm", "bert", "nonfinite", "mid",
          "a bad record (features in the wrong units, x1e30) enters at step 70 through inputs_embeds: the "
          "inputs are finite, but the embeddings' LayerNorm overflows computing their variance and outputs "
          "NaN (a data shift; float32 max ~3.4e38)")
def bert_nonfinite_huge_input_layernorm(run_dir: str) -> Oracle:
    g = seed_all(23)
    model = _classifier("sdpa")
    teacher = torch.randn(E, generator=g)
    bad_step = 70
    cur = [0]
    seen = {}

    def batch(step):
        cur[0] = step
        _, mask = _padded(g, 32)
        x = torch.randn(32, T, E, generator=g) * mask[..., None]
        y = ((x @ teacher).sum(1) > 0).long()
        if step == bad_step:
            x[5] = x[5] * 1e30  # one record in the wrong units
        return {"inputs_embeds": x, "attention_mask": mask, "labels": y}, None

    # The oracle: the first step at which the embeddings' LayerNorm outputs NaN/Inf while its input
    # is finite (a forward hook of ours): a NaN born in a weighted module.
    def hook(module, args, out):
        if torch.is_grad_enabled() and "step" not in seen and not torch.isfinite(out).all() and torch.isfinite(args[0]).all():
            seen["step"] = cur[0]
            seen["nan"] = bool(out.isnan().any())
            seen["input_max_abs"] = float(args[0].abs().max())

    model.bert.embeddings.LayerNorm.register_forward_hook(hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = record_loop(model, run_dir, batch, 100, opt)
    assert seen.get("step") == bad_step and seen["nan"], seen
    assert all(map(math.isfinite, losses[:bad_step])) and not math.isfinite(losses[bad_step])
    return Oracle("nonfinite", step=bad_step, where=["bert.embeddings.LayerNorm"], step_tolerance=0,
                  evidence={**seen, "loss_before": losses[bad_step - 1], "loss_at": str(losses[bad_step])})


@scenario("bert_nonfinite_sqrt_distance_backward", "bert", "nonfinite", "mid",
          "NaN born in the backward pass: the gradient of sqrt(sum((a-b)^2)) at a zero distance is 0 * inf "
          "(pytorch/pytorch#2421 'Gradient of zero norm is nan'); a siamese BERT trained with a contrastive "
          "loss (Hadsell et al. 2006) meets an exact duplicate pair at step 90")
def bert_nonfinite_sqrt_distance_backward(run_dir: str) -> Oracle:
    from transformers import BertModel

    g = seed_all(24)
    # no dropout: the two towers are one deterministic model, as at evaluation
    model = BertModel(_config("sdpa", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    bad_step, b = 90, 16
    cur = [0]
    seen = {}
    per_step = {}

    def batch(step):
        cur[0] = step
        a, ma = _padded(g, b)
        pos = torch.rand(b, generator=g) < 0.5
        # positives: a with ~20% of its tokens replaced; negatives: fresh sequences
        c, mc = _padded(g, b)
        swap = (torch.rand(b, T, generator=g) < 0.2) & ma.bool()
        near = torch.where(swap, torch.randint(5, V, (b, T), generator=g), a) * ma
        near[:, 1] = (a[:, 1] - 5 + 1) % (V - 5) + 5  # at least one token differs
        other = torch.where(pos[:, None], near, c)
        mother = torch.where(pos[:, None], ma, mc)
        if step == bad_step:  # an exact duplicate pair, labelled positive
            pos[3] = True
            other[3], mother[3] = a[3], ma[3]
        return {"input_ids": torch.cat([a, other]), "attention_mask": torch.cat([ma, mother])}, pos.float()

    def loss_fn(out, y):
        e = out.pooler_output
        if torch.is_grad_enabled():
            step = cur[0]

            def grad_hook(grad):  # the gradient arriving at the pooler's output, from the loss
                if "grad_step" not in seen and not torch.isfinite(grad).all():
                    seen["grad_step"] = step
            e.register_hook(grad_hook)
        d = torch.sqrt(((e[:b] - e[b:]) ** 2).sum(-1))  # the bug: F.pairwise_distance adds an eps
        if cur[0] == bad_step:
            seen["distance_of_duplicate"] = float(d[3])
        margin = 1.0
        loss = (y * d ** 2 + (1 - y) * torch.relu(margin - d) ** 2).mean()
        return loss

    def before_update(step):
        per_step[step] = grad_norms(model)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = record_loop(model, run_dir, batch, 110, opt, loss_fn=loss_fn, before_update=before_update)
    # The oracle: the first step whose gradient arriving at the pooler's output (a tensor hook of
    # ours) is non-finite while that step's loss is finite: the NaN is born in the loss's backward
    # (sqrt at 0) and enters the model at its last module, the pooler (tanh over a dense layer),
    # whose parameters are the first to get NaN gradients; every gradient of that step is NaN then.
    nonfinite_params = [n for n, v in per_step[bad_step].items() if not math.isfinite(v)]
    assert seen.get("grad_step") == bad_step and seen["distance_of_duplicate"] == 0.0, seen
    assert math.isfinite(losses[bad_step]) and all(map(math.isfinite, losses[:bad_step]))
    assert all(math.isfinite(v) for s in range(bad_step) for v in per_step[s].values())
    assert {"pooler.dense.weight", "pooler.dense.bias"} <= set(nonfinite_params), nonfinite_params
    return Oracle("nonfinite", step=bad_step, where=[LOSS], step_tolerance=0,
                  evidence={**seen, "loss_at": losses[bad_step], "loss_after": str(losses[bad_step + 1]),
                            "params_with_nonfinite_grad_at_step": len(nonfinite_params),
                            "params": len(per_step[bad_step])})
