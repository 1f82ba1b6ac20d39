"""GPT-2 scenarios: a tiny transformers.GPT2LMHeadModel (random init, nothing downloaded) trained
as a language model (its own .loss, labels=input_ids) on synthetic token sequences with learnable
structure: arithmetic progressions modulo the vocabulary, x_t = (a + b*t) mod V with a random start
a and a random stride b in {1, 2, 3} (the next token follows from the previous two).

Attention oracles: the normalised entropy (base.attention_entropy) of the attention probabilities
the model itself returns (output_attentions=True), measured on a fixed probe batch by a separate
eager-attention copy of the model loaded with the recorded model's current weights (so that the
recorded model never runs an extra forward, and an sdpa model is probed with eager attention),
over the keys each query may attend to (the causal mask). Probes are taken in batch(step), before
the step's forward, so a probe at step s sees the weights step s's forward uses.
"""

from __future__ import annotations

import math

import torch

from .base import Oracle, attention_entropy, first_step, grad_norms, record_loop, rss_mib, scenario, seed_all

V, T, E, LAYERS, HEADS = 64, 32, 32, 2, 2
COLLAPSED = 0.1  # a layer's attention is collapsed when its mean normalised entropy is below this (near one-hot)


def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()


def _model(impl: str, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet()
    cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=E, n_layer=LAYERS, n_head=HEADS, bos_token_id=0,
                     eos_token_id=0, attn_implementation=impl, **kw)
    return GPT2LMHeadModel(cfg)


def _progressions(g: torch.Generator, b: int = 16) -> torch.Tensor:
    a = torch.randint(0, V, (b, 1), generator=g)
    stride = torch.randint(1, 4, (b, 1), generator=g)
    return (a + stride * torch.arange(T)) % V


class _Probe:
    """Per-layer normalised attention entropy of the model's current weights on a fixed batch,
    from an eager-attention copy (dropout off)."""

    def __init__(self, model, g: torch.Generator):
        self.model = model
        self.copy = _model("eager", **{k: getattr(model.config, k) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")})
        self.copy.eval()
        self.ids = _progressions(g, 8)
        self.valid = torch.ones(T, T, dtype=torch.bool).tril().expand(8, HEADS, T, T)
        self.history: dict[int, list[float]] = {}

    def __call__(self, step: int) -> list[float]:
        self.copy.load_state_dict(self.model.state_dict())
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            att = self.copy(self.ids, output_attentions=True).attentions
        ent = [attention_entropy(a, self.valid) for a in att]
        self.history[step] = ent
        return ent


def _lm_batch(g):
    def batch(step):
        x = _progressions(g)
        return {"input_ids": x, "labels": x}, None

    return batch


def _global(norms: dict[str, float]) -> float:
    return math.sqrt(sum(v * v for v in norms.values() if not math.isnan(v)))


def _healthy_run(run_dir: str, impl: str, bf16: bool, seed: int) -> Oracle:
    g = seed_all(seed)
    model = _model(impl)
    probe = _Probe(model, g)
    data = _lm_batch(g)
    steps, warm, peak = 300, 30, 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=peak, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
    norms = []

    def batch(step):
        if step % 10 == 0 or step == steps - 1:
            probe(step)
        return data(step)

    def before_update(step):
        norms.append(_global(grad_norms(model)))

    if bf16:
        # autocast around each forward (the model's own loss included), as the AMP docs prescribe:
        # a context held around the whole loop would keep serving the bf16 copies of the weights
        # it cached at step 0 (the cache is cleared only when the context exits), and nothing would train.
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    losses = record_loop(model, run_dir, batch, steps, opt, before_update=before_update, clip=1.0, scheduler=sched)
    # The oracle of health: the loss falls clearly (last 20 steps under half the first 20), every
    # loss and gradient norm is finite, no gradient-norm surge (max under 10x the median), and no
    # layer's attention is ever collapsed on the probe batch (entropy always above 0.3).
    ents = [e for es in probe.history.values() for e in es]
    med = sorted(norms)[len(norms) // 2]
    assert all(map(math.isfinite, losses + norms)), "non-finite"
    assert sum(losses[-20:]) < 0.5 * sum(losses[:20]), losses[::30]
    assert max(norms) < 10 * med, (max(norms), med)
    assert min(ents) > 0.3, probe.history
    return Oracle(None, evidence={"loss_first20": sum(losses[:20]) / 20, "loss_last20": sum(losses[-20:]) / 20,
                                  "grad_norm_median": med, "grad_norm_max": max(norms),
                                  "min_attention_entropy": min(ents)})


@scenario("gpt2_healthy_adamw_warmup_cosine_clip", "gpt2", None, "healthy",
          "the usual GPT-2 recipe: AdamW, linear warm-up then cosine decay, gradient clipping at 1.0 "
          "(Radford et al. 2019; Loshchilov & Hutter 2019; nanoGPT)")
def gpt2_healthy_adamw_warmup_cosine_clip(run_dir: str) -> Oracle:
    return _healthy_run(run_dir, "eager", bf16=False, seed=10)


@scenario("gpt2_healthy_bf16_autocast", "gpt2", None, "healthy",
          "mixed precision on CPU: torch.autocast('cpu', dtype=torch.bfloat16) (PyTorch AMP docs), "
          "AdamW warm-up + cosine, clipping, sdpa attention")
def gpt2_healthy_bf16_autocast(run_dir: str) -> Oracle:
    return _healthy_run(run_dir, "sdpa", bf16=True, seed=11)


@scenario("gpt2_attention_collapse_qk_init", "gpt2", "attention_collapse", "init",
          "attention entropy collapse: attention logits so large that softmax rows are one-hot "
          "(Zhai et al. 2023, 'Stabilizing Transformer Training by Preventing Attention Entropy Collapse'); "
          "here from a query/key initialisation 60x too large")
def gpt2_attention_collapse_qk_init(run_dir: str) -> Oracle:
    g = seed_all(12)
    model = _model("eager")
    with torch.no_grad():  # c_attn (Conv1D, weight [E, 3E]) = [query | key | value]: scale query and key x60
        for blk in model.transformer.h:
            blk.attn.c_attn.weight[:, :2 * E] *= 60.0
    probe = _Probe(model, g)
    data = _lm_batch(g)

    def batch(step):
        if step < 10 or step % 10 == 0:
            probe(step)
        return data(step)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 150, opt)
    # Collapse at a step: a layer's mean normalised attention entropy on the probe batch < 0.1.
    # step: the first probed step at which any layer is collapsed; where: the layers collapsed on
    # every probe of the run (both, as both were scaled).
    steps = sorted(probe.history)
    onset = first_step([probe.history[s] for s in steps], lambda es: min(es) < COLLAPSED)
    assert onset is not None and steps[onset] == 0, probe.history
    where = [f"transformer.h.{i}.attn" for i in range(LAYERS) if all(probe.history[s][i] < COLLAPSED for s in steps)]
    assert where, probe.history
    assert all(map(math.isfinite, losses))
    return Oracle("attention_collapse", step=0, where=where, step_tolerance=10,
                  evidence={"entropy_step0": probe.history[0], "entropy_last": probe.history[steps[-1]],
                            "max_entropy_any_probe": max(max(v) for v in probe.history.values())})


@scenario("gpt2_attention_collapse_lr_jump", "gpt2", "attention_collapse", "mid",
          "attention entropy collapse at a high learning rate (Zhai et al. 2023, 'Stabilizing Transformer "
          "Training by Preventing Attention Entropy Collapse'); here the AdamW lr jumps 100x (1e-3 -> 0.1) "
          "at step 100, as a mis-set schedule would")
def gpt2_attention_collapse_lr_jump(run_dir: str) -> Oracle:
    g = seed_all(13)
    model = _model("sdpa")
    probe = _Probe(model, g)
    data = _lm_batch(g)
    jump = 100
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch(step):
        for pg in opt.param_groups:
            pg["lr"] = 1e-3 if step < jump else 0.1
        if step % 10 == 0 or step >= jump - 5:
            probe(step)
        return data(step)

    losses = record_loop(model, run_dir, batch, 200, opt)
    # Collapse at a step: a layer's mean normalised attention entropy on the probe batch < 0.1.
    # step: the first probed step at which any layer is; where: the layers whose median entropy
    # over the probes from that step to the end is < 0.1.
    steps = sorted(probe.history)
    i = first_step([probe.history[s] for s in steps], lambda es: min(es) < COLLAPSED)
    assert i is not None, probe.history
    onset = steps[i]
    after = [probe.history[s] for s in steps if s >= onset]
    where = [f"transformer.h.{l}.attn" for l in range(LAYERS)
             if sorted(e[l] for e in after)[len(after) // 2] < COLLAPSED]
    before = [probe.history[s] for s in steps if s < jump]
    assert onset > jump and min(min(e) for e in before) > 0.5 and where, probe.history
    return Oracle("attention_collapse", step=onset, where=where, step_tolerance=10,
                  evidence={"min_entropy_before_jump": min(min(e) for e in before),
                            "entropy_at_onset": probe.history[onset],
                            "median_entropy_after": [sorted(e[l] for e in after)[len(after) // 2] for l in range(LAYERS)],
                            "loss_before_jump": losses[jump - 1], "loss_last": losses[-1]})


@scenario("gpt2_exploding_gradients_sgd_lr_spike", "gpt2", "exploding_gradients", "mid",
          "exploding gradients (Pascanu et al. 2013, 'On the difficulty of training recurrent neural "
          "networks'): a learning-rate spike (SGD 0.1 -> 5 at step 100) drives the weights up and the "
          "gradient norm grows by orders of magnitude step after step")
def gpt2_exploding_gradients_sgd_lr_spike(run_dir: str) -> Oracle:
    g = seed_all(14)
    model = _model("sdpa")
    data = _lm_batch(g)
    spike = 100
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []

    def batch(step):
        for pg in opt.param_groups:
            pg["lr"] = 0.1 if step < spike else 5.0
        return data(step)

    def before_update(step):
        per_step.append(grad_norms(model))

    losses = record_loop(model, run_dir, batch, 120, opt, before_update=before_update)
    # Exploding at a step: the global gradient norm (from p.grad) exceeds 100x its median over the
    # steps before the spike. where: the parameters whose own gradient norm exceeds 100x their own
    # pre-spike median at that step (gradients of all layers explode together).
    total = [_global(n) for n in per_step]
    base = sorted(total[:spike])[spike // 2]
    onset = first_step(total, lambda v: v > 100 * base)
    assert onset is not None and onset > spike, total[spike - 2:]
    names = list(per_step[0])
    med = {n: sorted(per_step[s][n] for s in range(spike))[spike // 2] for n in names}
    where = [n for n in names if per_step[onset][n] > 100 * med[n]]
    assert where
    nan_at = first_step(total, lambda v: not math.isfinite(v) or v == 0)
    return Oracle("exploding_gradients", step=onset, where=where, step_tolerance=2,
                  evidence={"median_grad_norm_before": base, "grad_norm_by_step": {s: total[s] for s in range(spike - 1, min(onset + 3, len(total)))},
                            "loss_before": losses[spike - 1], "loss_at_onset": losses[onset],
                            "first_nonfinite_or_zero_step": nan_at})


@scenario("gpt2_nonfinite_embedding_row_neg_inf", "gpt2", "nonfinite", "mid",
          "a corrupted embedding row (-inf) written at step 80 (e.g. a bad checkpoint merge or an "
          "in-place vocabulary edit): the token embedding's output is -inf for that token, LayerNorm "
          "then makes NaN (-inf - -inf), and the run is NaN from there")
def gpt2_nonfinite_embedding_row_neg_inf(run_dir: str) -> Oracle:
    g = seed_all(15)
    model = _model("eager")
    data = _lm_batch(g)
    bad_step, bad_token = 80, 7
    seen = {}
    cur = [0]

    # The oracle: the first step whose wte (token embedding) output holds -inf while its input
    # (token ids) is finite, seen by a forward hook of ours: a NaN/Inf born in a weighted module.
    def hook(module, args, out):
        if torch.is_grad_enabled() and "step" not in seen and not torch.isfinite(out).all():
            seen["step"] = cur[0]
            seen["neg_inf"] = bool((out == float("-inf")).any())

    model.transformer.wte.register_forward_hook(hook)

    def batch(step):
        cur[0] = step
        x, y = data(step)
        if step == bad_step:
            with torch.no_grad():
                model.transformer.wte.weight[bad_token] = float("-inf")
            assert (x["input_ids"] == bad_token).any()
        return x, y

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 100, opt)
    assert seen.get("step") == bad_step and seen["neg_inf"], seen
    assert all(map(math.isfinite, losses[:bad_step])) and not math.isfinite(losses[bad_step])
    return Oracle("nonfinite", step=bad_step, where=["transformer.wte"], step_tolerance=0,
                  evidence={"first_nonfinite_wte_output_step": seen["step"], "loss_before": losses[bad_step - 1],
                            "loss_at": losses[bad_step]})


@scenario("gpt2_nonfinite_loss_all_labels_ignored", "gpt2", "nonfinite", "mid",
          "cross-entropy's mean over zero target tokens is 0/0 = NaN when every label is ignore_index "
          "(-100), e.g. a fine-tuning batch whose answers were all masked or truncated away "
          "(pytorch/pytorch#70348, #116349; OpenRLHF#583)")
def gpt2_nonfinite_loss_all_labels_ignored(run_dir: str) -> Oracle:
    g = seed_all(16)
    model = _model("sdpa")
    data = _lm_batch(g)
    bad_step = 90
    per_step = {}

    def batch(step):
        x, y = data(step)
        if step == bad_step:  # the prompt mask covers every token of every sequence of this batch
            x["labels"] = torch.full_like(x["labels"], -100)
        return x, y

    def before_update(step):
        per_step[step] = grad_norms(model)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 150, opt, before_update=before_update)
    # The oracle: the first step whose loss (the model's own .loss) is non-finite. The NaN is born
    # in the loss function (mean over an empty set of tokens), in no module's output and in no
    # gradient: every gradient at that step is finite (exactly zero), so `where` names nothing.
    onset = first_step(losses, lambda v: not math.isfinite(v))
    assert onset == bad_step and math.isnan(losses[onset]), losses[bad_step - 2:bad_step + 2]
    assert all(math.isfinite(v) and v == 0.0 for v in per_step[bad_step].values())
    assert all(map(math.isfinite, losses[bad_step + 1:]))
    return Oracle("nonfinite", step=bad_step, where=[], step_tolerance=0,
                  evidence={"loss_before": losses[bad_step - 1], "loss_at": str(losses[bad_step]),
                            "loss_after": losses[bad_step + 1], "grad_norms_at": "all 0.0"})


@scenario("gpt2_memory_leak_kept_logits", "gpt2", "memory_leak", "mid",
          "keeping a tensor that still holds its autograd graph across iterations keeps every step's "
          "saved activations alive (PyTorch FAQ, 'My model reports out of memory': don't accumulate "
          "history across your training loop); here the logits are kept for a later metric from step 60")
def gpt2_memory_leak_kept_logits(run_dir: str) -> Oracle:
    g = seed_all(17)
    model = _model("eager")
    data = _lm_batch(g)
    leak_from, steps = 60, 260
    kept = []
    rss = []

    def loss_fn(out, y):
        if len(rss) - 1 >= leak_from:  # rss holds one reading per step begun: this is step len(rss) - 1
            kept.append(out.logits)  # the bug: out.logits.detach() was meant
        return out.loss

    def batch(step):
        rss.append(rss_mib())
        x = _progressions(g, 32)
        return {"input_ids": x, "labels": x}, None

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, steps, opt, loss_fn=loss_fn)
    rss.append(rss_mib())
    # The oracle: resident memory (ours, /proc/self/statm) grows steadily from the step the
    # logits are first kept (with their graphs: grad_fn set), and not before it.
    assert all(t.grad_fn is not None for t in kept)
    warm = 20  # allocator warm-up
    before = (rss[leak_from] - rss[warm]) / (leak_from - warm)
    after = (rss[-1] - rss[leak_from]) / (steps - leak_from)
    grown = rss[-1] - rss[leak_from]
    assert grown > 100 and after > 5 * max(before, 0.05), (before, after, grown)
    return Oracle("memory_leak", step=leak_from, where=[], step_tolerance=50,
                  evidence={"rss_mib_at_leak_start": rss[leak_from], "rss_mib_end": rss[-1],
                            "mib_per_step_before": before, "mib_per_step_after": after,
                            "kept_tensors_with_graph": len(kept), "loss_last": losses[-1]})
