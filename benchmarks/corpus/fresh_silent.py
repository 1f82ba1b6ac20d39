"""Fresh scenarios of the silent training bugs (split "fresh": written by other hands than the
detectors', without reading them, and held out from all tuning): parameters that never learn, a
loop that never clears its gradients, training and evaluation in the wrong module mode, and bad
input batches; with healthy look-alikes of each. Each is a short real training run recorded by the
default Recorder; the oracle is the scenario's own measurement:

- params_not_learning: every parameter copied before the first step and compared, bit for bit,
  after the last (torch.equal); where = the parameters that never changed, asserted to be exactly
  the planted ones (every other parameter changed); p.grad seen before each update as evidence.
- missing_zero_grad: the gradient already in p.grad before each step's backward (left over from
  earlier steps) against the step's own gradient (what the backward added); step = the first step
  whose update applies a gradient left over from an earlier step.
- train_eval_mode: a forward pre-hook of the scenario's own on the model notes, for every forward,
  the recorder step it falls in (rec.step() calls so far), whether autograd is on, and which
  Dropout/BatchNorm modules are in training mode; step = the first training forward (autograd on,
  followed by a backward) run with such modules in eval mode, or the first evaluation forward
  (under torch.no_grad()) run with them in training mode; where = those modules.
- input_data: the batch itself, as the model receives it (mean, std, per-feature std, max |x|),
  against what the pipeline should have delivered (the real processor's output, the scaled column,
  the steps before the change).
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from .base import Oracle, first_step, grad_norms, hf, record_loop, scenario, seed_all

_NORM_OR_DROPOUT = (nn.Dropout, nn.modules.batchnorm._BatchNorm)


# -- shared helpers ------------------------------------------------------------------------------

def _bert(tf, dropout: float = 0.1, V: int = 64, T: int = 32):
    return tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=T, num_labels=2, pad_token_id=0, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout))


def _vit(tf, dropout: float = 0.0, n_cls: int = 8):
    return tf.ViTForImageClassification(tf.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=n_cls, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))


def _token_task(g: torch.Generator, V: int = 64, T: int = 32, n: int = 32):
    """Token sequences ([CLS] = 1 first) of two "topics": each token is drawn, with probability
    0.6, from its class's half of the vocabulary (5..34 or 35..V-1), else from all of it."""

    def make():
        y = torch.randint(0, 2, (n,), generator=g)
        lo = torch.where(y == 1, 5, 35)[:, None]
        own = lo + torch.randint(0, 30, (n, T), generator=g)
        anywhere = torch.randint(5, V, (n, T), generator=g)
        ids = torch.where(torch.rand(n, T, generator=g) < 0.6, own, anywhere).clamp(max=V - 1)
        ids[:, 0] = 1
        return ids, y

    return make


def _image_classes(g: torch.Generator, n_cls: int = 8, size: int = 16):
    """Decoded images as a loader gives them (uint8, N x 3 x size x size, 0..255): each class a
    smooth random template, plus noise."""
    tpl = F.avg_pool2d(torch.randn(n_cls, 3, size + 4, size + 4, generator=g), 5, 1)
    tpl = tpl / tpl.std()

    def sample(n: int, noise: float = 1.0):
        y = torch.randint(0, n_cls, (n,), generator=g)
        x = tpl[y] + noise * torch.randn(n, 3, size, size, generator=g)
        return (128 + 45 * x).round().clamp(0, 255).to(torch.uint8), y

    return sample


def _channel_normaliser(sample, n: int = 512):
    """torchvision-style Normalize with the dataset's own channel means and stds (from n images)."""
    x, _ = sample(n)
    x = x.float() / 255
    mean, std = x.mean((0, 2, 3))[:, None, None], x.std((0, 2, 3))[:, None, None]
    return lambda u8: (u8.float() / 255 - mean) / std


class _SmallCNN(nn.Module):
    """conv-BN-ReLU x 2, global pooling, dropout, linear: the textbook small image classifier."""

    def __init__(self, n_cls: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(32, n_cls)

    def forward(self, x):
        return self.fc(self.drop(self.features(x)))


class _TokenEncoder(nn.Module):
    """Token classifier on nn.TransformerEncoder (Pre-LN): embedding + learnt positions, a lower and
    an upper encoder, mean pooling, a linear head. no_grad_lower: the lower part runs under
    torch.no_grad() (the bug of one scenario)."""

    def __init__(self, vocab: int = 64, d: int = 32, T: int = 32, n_cls: int = 2, no_grad_lower: bool = False):
        super().__init__()
        self.no_grad_lower = no_grad_lower
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(T, d))

        def encoder():
            layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
            return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

        self.lower, self.upper = encoder(), encoder()
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids):
        with torch.no_grad() if self.no_grad_lower else contextlib.nullcontext():
            h = self.lower(self.embed(ids) + self.pos[None])
        return self.head(self.upper(h).mean(1))


def _falls(losses: list[float], frac: float, k: int = 10) -> dict:
    """The loss is finite and its mean over the last k steps is under frac x that of the first k."""
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert all(map(math.isfinite, losses)) and last < frac * first, (first, last, losses[::5])
    return {"loss_first10": first, "loss_last10": last}


# -- params_not_learning: helpers ---------------------------------------------------------------

def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model: nn.Module, snap: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in model.named_parameters() if torch.equal(p.detach(), snap[n])]


def _optimized(model: nn.Module, opt) -> set[str]:
    ids = {id(p) for group in opt.param_groups for p in group["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def _grad_summary(norms: list[dict], names: list[str]) -> dict:
    """How each named parameter's gradient looked over the run, from p.grad before each update."""
    out = {}
    for n in names:
        v = [s[n] for s in norms]
        out[n] = ("None every step" if all(math.isnan(x) for x in v) else
                  "exactly 0 every step" if all(x == 0 for x in v) else
                  f"median norm {statistics.median(x for x in v if not math.isnan(x)):.3g}")
    return out


def _not_learning_oracle(model: nn.Module, snap: dict, planted: list[str], losses: list[float],
                         norms: list[dict], opt, **evidence) -> Oracle:
    """where = the parameters equal, bit for bit, after the run to what they were before its first
    step, asserted to be exactly the planted ones (every other parameter changed); present from the
    first step (step 0; tolerance 10: a parameter's change is seen on the steps that look at it)."""
    never = _unchanged(model, snap)
    assert sorted(never) == sorted(planted), (sorted(set(never) ^ set(planted)))
    assert all(map(math.isfinite, losses)), losses[::5]
    grads = _grad_summary(norms, never)
    shown = dict(list(grads.items())[:12])
    opted = _optimized(model, opt)
    return Oracle("params_not_learning", step=0, where=never, step_tolerance=10,
                  evidence={"n_never_changed": len(never), "n_params": len(snap),
                            "never_changed_in_optimizer": sum(n in opted for n in never),
                            "never_changed_requires_grad": sum(p.requires_grad for n, p in model.named_parameters()
                                                               if n in never),
                            "gradient_of_never_changed": shown, "loss_first": losses[0],
                            "loss_last10": sum(losses[-10:]) / 10, **evidence})


# -- params_not_learning ------------------------------------------------------------------------

class _LoRALinear(nn.Module):
    """A LoRA adapter around a Linear (Hu et al. 2021; PEFT's names): base_layer(x) + B(A(x)) x
    alpha/r, A Kaiming-uniform, B zero (so that the adapted model starts as the base model)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _add_lora(bert_model) -> list[str]:
    """LoRA on every self-attention's query and value (the LoRA paper's choice); the adapters' names."""
    for layer in bert_model.bert.encoder.layer:
        att = layer.attention.self
        att.query = _LoRALinear(att.query)
        att.value = _LoRALinear(att.value)
    return [n for n, _ in bert_model.named_parameters() if ".lora_" in n]


@scenario("fresh_bert_lora_adapters_added_after_optimizer", "bert", "params_not_learning", "init",
          "LoRA (Hu et al. 2021) adapters injected into BERT's query/value projections after the optimizer had "
          "been built over model.parameters(): an optimizer only updates the Parameter objects it was given at "
          "construction (torch.optim docs), so the adapters get gradients and never change while the base "
          "model is fully fine-tuned (PEFT's docs build the optimizer after get_peft_model)", fresh=True)
def fresh_bert_lora_adapters_added_after_optimizer(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(520)
    model = _bert(tf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the trainer's setup, done first
    lora = _add_lora(model)  # the bug: a later config flag adds the adapters after the optimizer exists
    data = _token_task(g)
    snap = _snapshot(model)
    norms: list[dict] = []

    def batch(step):
        ids, y = data()
        return {"input_ids": ids, "labels": y}, None

    losses = record_loop(model, run_dir, batch, 60, opt, before_update=lambda s: norms.append(grad_norms(model)))
    # The adapters' B gets a gradient every step; A's is exactly 0 (B stays 0); neither is in the optimizer.
    assert not (set(lora) & _optimized(model, opt))
    assert all(norms[-1][n] > 0 for n in lora if "lora_B" in n), norms[-1]
    return _not_learning_oracle(model, snap, lora, losses, norms, opt, adapters=len(lora))


class _LMWithTopicHead(nn.Module):
    """A GPT-2 language model with an auxiliary topic classifier on its last hidden states
    (multi-task: next-token prediction + the document's topic)."""

    def __init__(self, tf, vocab: int, n_topics: int):
        super().__init__()
        self.lm = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2,
                                                   n_head=2))
        self.topic_head = nn.Linear(32, n_topics)

    def forward(self, input_ids):
        out = self.lm(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
        return out.loss, self.topic_head(out.hidden_states[-1].mean(1))


@scenario("fresh_gpt2_aux_topic_loss_logged_never_added", "gpt2", "params_not_learning", "init",
          "an auxiliary head (GoogLeNet's auxiliary classifiers, Szegedy et al. 2015; multi-task heads) whose "
          "loss is computed and logged but never added to the loss that is backpropagated (`loss = lm_loss`, "
          "the `+ 0.3 * topic_loss` term dropped in a refactor): the head gets no gradient and never changes",
          fresh=True)
def fresh_gpt2_aux_topic_loss_logged_never_added(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(521)
    vocab, n_topics, length = 48, 4, 24
    chains = torch.softmax(3.0 * torch.randn(n_topics, vocab, vocab, generator=g), -1)  # a Markov chain per topic
    model = _LMWithTopicHead(tf, vocab, n_topics)

    def batch(step):
        topic = torch.randint(0, n_topics, (32,), generator=g)
        seq = torch.empty(32, length, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (32,), generator=g)
        for t in range(1, length):
            seq[:, t] = torch.multinomial(chains[topic, seq[:, t - 1]], 1, generator=g)[:, 0]
        return (seq,), topic

    topic_losses: list[float] = []

    def loss_fn(out, topic):
        lm_loss, topic_logits = out
        topic_loss = F.cross_entropy(topic_logits, topic)
        topic_losses.append(float(topic_loss.detach()))  # logged every step...
        return lm_loss  # ...the bug: `lm_loss + 0.3 * topic_loss` lost in a refactor

    snap = _snapshot(model)
    norms: list[dict] = []
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = record_loop(model, run_dir, batch, 60, opt, loss_fn,
                         before_update=lambda s: norms.append(grad_norms(model)))
    head = ["topic_head.weight", "topic_head.bias"]
    assert all(math.isnan(s[n]) for s in norms for n in head)
    return _not_learning_oracle(model, snap, head, losses, norms, opt,
                                topic_loss_first10=sum(topic_losses[:10]) / 10,
                                topic_loss_last10=sum(topic_losses[-10:]) / 10, chance=math.log(n_topics))


@scenario("fresh_transformer_no_grad_left_around_lower_encoder", "transformer", "params_not_learning", "init",
          "a `with torch.no_grad():` left around the embedding and the lower encoder layer of an "
          "nn.TransformerEncoder classifier from a frozen-features experiment (Devlin et al. 2019's "
          "feature-based approach) after switching to full training: no graph is built there (PyTorch docs, "
          "'Locally disabling gradient computation'), so those parameters, trainable and in the optimizer, "
          "never get a gradient", fresh=True)
def fresh_transformer_no_grad_left_around_lower_encoder(run_dir: str) -> Oracle:
    g = seed_all(522)
    data = _token_task(g)
    model = _TokenEncoder(no_grad_lower=True)
    snap = _snapshot(model)
    norms: list[dict] = []
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = record_loop(model, run_dir, lambda s: data(), 60, opt, F.cross_entropy,
                         before_update=lambda s: norms.append(grad_norms(model)))
    planted = [n for n, _ in model.named_parameters() if n.split(".")[0] in ("embed", "pos", "lower")]
    return _not_learning_oracle(model, snap, planted, losses, norms, opt)


class _DualEncoder(nn.Module):
    """A CLIP-style dual encoder (Radford et al. 2021): two MLP towers, cosine similarities scaled
    by a learnt temperature exp(logit_scale), clipped at 100 as CLIP does."""

    def __init__(self, init_temperature: float):
        super().__init__()
        self.image_encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.text_encoder = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 32))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / init_temperature)))

    def forward(self, img, txt):
        a = F.normalize(self.image_encoder(img), dim=-1)
        b = F.normalize(self.text_encoder(txt), dim=-1)
        return self.logit_scale.exp().clamp(max=100) * a @ b.T


@scenario("fresh_mlp_clip_temperature_init_past_clip_zero_grad", "mlp", "params_not_learning", "init",
          "CLIP's learnable temperature (Radford et al. 2021, sec. 2.5: initialised to 0.07, the logit scale "
          "clipped at 100) initialised to 0.005 for 'sharper' logits: exp(logit_scale) = 200 lies beyond the "
          "clip, whose gradient there is exactly 0, so the temperature gets a zero gradient every step and "
          "Adam never moves it", fresh=True)
def fresh_mlp_clip_temperature_init_past_clip_zero_grad(run_dir: str) -> Oracle:
    g = seed_all(523)
    a, b = torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)

    def batch(step):  # paired views of one latent: "image" and "text" features
        z = torch.randn(64, 8, generator=g)
        return (z @ a + 0.3 * torch.randn(64, 32, generator=g), z @ b + 0.3 * torch.randn(64, 16, generator=g)), None

    def loss_fn(logits, _):
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    model = _DualEncoder(init_temperature=0.005)  # the bug: exp(log(1/0.005)) = 200 > the clip at 100
    snap = _snapshot(model)
    norms: list[dict] = []
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 60, opt, loss_fn,
                         before_update=lambda s: norms.append(grad_norms(model)))
    assert all(s["logit_scale"] == 0 for s in norms)  # a gradient, exactly 0, every step
    return _not_learning_oracle(model, snap, ["logit_scale"], losses, norms, opt,
                                logit_scale=float(model.logit_scale.detach()),
                                scale=float(model.logit_scale.detach().exp()),
                                **_falls(losses, 0.9))


@scenario("fresh_vit_stage2_full_finetune_forgot_unfreeze", "vit", "params_not_learning", "init",
          "linear probing then fine-tuning (LP-FT, Kumar et al. 2022): stage 1 freezes the ViT encoder "
          "(requires_grad=False) and trains the head; stage 2 builds AdamW over model.parameters() for full "
          "fine-tuning but the loop that sets requires_grad back to True was left out: the frozen encoder's "
          "parameters are handed to the optimizer and never change", fresh=True)
def fresh_vit_stage2_full_finetune_forgot_unfreeze(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(524)
    model = _vit(tf)
    proc = tf.ViTImageProcessor(size={"height": 16, "width": 16})
    sample = _image_classes(g)

    def batch(step):
        x, y = sample(32)
        return {"pixel_values": proc(images=list(x), return_tensors="pt").pixel_values, "labels": y}, None

    # stage 1 (not recorded): linear probe on the frozen encoder
    for p in model.vit.parameters():
        p.requires_grad_(False)
    probe = torch.optim.AdamW(model.classifier.parameters(), lr=3e-3)
    for step in range(15):
        x, _ = batch(step)
        probe.zero_grad()
        model(**x).loss.backward()
        probe.step()
    # stage 2: full fine-tuning. The bug: `for p in model.parameters(): p.requires_grad_(True)` is missing.
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    snap = _snapshot(model)
    norms: list[dict] = []
    losses = record_loop(model, run_dir, batch, 60, opt, before_update=lambda s: norms.append(grad_norms(model)))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith("vit.") for n in frozen) and set(frozen) <= _optimized(model, opt)
    return _not_learning_oracle(model, snap, frozen, losses, norms, opt)


# -- missing_zero_grad --------------------------------------------------------------------------

class _Leftover:
    """Each backward: the norm of the gradient already in p.grad before it (left over from earlier
    steps) and of what it added (the step's own gradient)."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.left: list[float] = []
        self.own: list[float] = []
        self._before: list = []

    def before_backward(self) -> None:
        self._before = [None if p.grad is None else p.grad.detach().clone() for p in self.params]

    def after_backward(self) -> None:
        left = own = 0.0
        for p, b in zip(self.params, self._before):
            if p.grad is None:
                continue
            new = p.grad.detach() if b is None else p.grad.detach() - b
            own += float(new.double().pow(2).sum())
            if b is not None:
                left += float(b.double().pow(2).sum())
        self.left.append(math.sqrt(left))
        self.own.append(math.sqrt(own))


def _no_zero_grad_oracle(tr: _Leftover, losses: list[float], clean: set[int], **evidence) -> Oracle:
    """step = the first step whose update applies gradient left over from earlier steps; asserted:
    exactly the steps in `clean` start from cleared gradients, and from the onset the leftover
    outweighs the step's own gradient most of the time (the update is mostly stale gradient)."""
    onset = first_step(tr.left, lambda v: v > 0)
    assert {s for s, v in enumerate(tr.left) if v == 0} == clean, [s for s, v in enumerate(tr.left) if v == 0]
    ratio = [l / o for l, o in zip(tr.left, tr.own)]
    later = ratio[onset:]
    assert statistics.median(later) > 2, later[::5]
    assert all(map(math.isfinite, losses)), losses[::5]
    return Oracle("missing_zero_grad", step=onset, where=[], step_tolerance=2,
                  evidence={"steps_from_cleared_gradients": sorted(clean),
                            "leftover_over_own_gradient": {s: round(ratio[s], 2) for s in range(0, len(ratio), 10)},
                            "median_leftover_over_own_from_onset": statistics.median(later),
                            "loss_first": losses[0], "loss_last10": sum(losses[-10:]) / 10, **evidence})


@scenario("fresh_mlp_zero_grad_indented_into_logging_block", "mlp", "missing_zero_grad", "init",
          "optimizer.zero_grad() indented into the `if step % log_every == 0:` block (log_every = 100) of a "
          "tabular MLP's loop: gradients are cleared once per 100 steps and each update applies the sum of "
          "all gradients since (PyTorch recipe 'Zeroing out gradients in PyTorch': gradients accumulate on "
          "every backward)", fresh=True)
def fresh_mlp_zero_grad_indented_into_logging_block(run_dir: str) -> Oracle:
    from torchautopsy import Recorder

    g = seed_all(530)
    w = torch.randn(12, generator=g)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tr = _Leftover(model)
    losses, log, steps, log_every = [], [], 150, 100
    with Recorder(model, run_dir) as rec:
        for step in range(steps):
            x = torch.randn(64, 12, generator=g)
            y = (x @ w + 0.5 * torch.randn(64, generator=g) > 0).long()
            loss = F.cross_entropy(model(x), y)
            tr.before_backward()
            loss.backward()
            tr.after_backward()
            opt.step()
            if step % log_every == 0:
                log.append((step, float(loss.detach())))
                opt.zero_grad()  # the bug: indented into the logging block
            rec.step(loss=loss)
            losses.append(float(loss.detach()))
    # Cleared before steps 0 (nothing yet) and 1, 101 (zero_grad at 0 and 100).
    return _no_zero_grad_oracle(tr, losses, {0, 1, 101}, log_every=log_every)


@scenario("fresh_bert_zero_grad_called_on_ema_copy", "bert", "missing_zero_grad", "init",
          "a model-EMA / mean-teacher loop (Tarvainen & Valpola 2017; Polyak averaging) whose `zero_grad()` is "
          "called on the EMA copy (`ema_model.zero_grad()`, a name slip) instead of the trained model: the "
          "copy has no gradients, the trained model's are never cleared", fresh=True)
def fresh_bert_zero_grad_called_on_ema_copy(run_dir: str) -> Oracle:
    from torchautopsy import Recorder

    tf = hf()
    g = seed_all(531)
    model = _bert(tf)
    ema_model = copy.deepcopy(model).requires_grad_(False)
    data = _token_task(g)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    tr = _Leftover(model)
    losses, decay = [], 0.99
    with Recorder(model, run_dir) as rec:
        for step in range(60):
            ids, y = data()
            loss = model(input_ids=ids, labels=y).loss
            ema_model.zero_grad()  # the bug: the EMA copy, not `model`
            tr.before_backward()
            loss.backward()
            tr.after_backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema_model.parameters(), model.parameters()):
                    pe.lerp_(p, 1 - decay)
            rec.step(loss=loss)
            losses.append(float(loss.detach()))
    return _no_zero_grad_oracle(tr, losses, {0}, ema_decay=decay)


@scenario("fresh_transformer_zero_grad_without_call_parentheses", "transformer", "missing_zero_grad", "init",
          "`optimizer.zero_grad` written without its parentheses: an attribute lookup with no effect (pylint "
          "W0104 pointless-statement, flake8-bugbear B018), so an nn.TransformerEncoder classifier's "
          "gradients accumulate over the whole run", fresh=True)
def fresh_transformer_zero_grad_without_call_parentheses(run_dir: str) -> Oracle:
    from torchautopsy import Recorder

    g = seed_all(532)
    data = _token_task(g)
    model = _TokenEncoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tr = _Leftover(model)
    losses = []
    with Recorder(model, run_dir) as rec:
        for step in range(60):
            ids, y = data()
            optimizer.zero_grad  # noqa: B018  (the bug: no call)
            loss = F.cross_entropy(model(ids), y)
            tr.before_backward()
            loss.backward()
            tr.after_backward()
            optimizer.step()
            rec.step(loss=loss)
            losses.append(float(loss.detach()))
    return _no_zero_grad_oracle(tr, losses, {0})


# -- train_eval_mode ------------------------------------------------------------------------------

class _Modes:
    """A forward pre-hook on the model: for every forward, (the recorder step it falls in, autograd
    on, the Dropout/BatchNorm modules in training mode). `step` is advanced by the scenario after
    each rec.step()."""

    def __init__(self, model: nn.Module):
        self.mods = {n: m for n, m in model.named_modules() if isinstance(m, _NORM_OR_DROPOUT)}
        assert self.mods
        self.step = 0
        self.calls: list[tuple[int, bool, frozenset]] = []
        self.handle = model.register_forward_pre_hook(self._pre)

    def _pre(self, module, args):
        on = frozenset(n for n, m in self.mods.items() if m.training)
        self.calls.append((self.step, torch.is_grad_enabled(), on))

    def training_in_eval(self):
        """(first step, modules in eval mode then) of the training forwards run in eval mode."""
        bad = [(s, sorted(set(self.mods) - on)) for s, grad, on in self.calls if grad and on != set(self.mods)]
        return bad[0] if bad else (None, [])

    def eval_in_train(self):
        """(first step, modules in training mode then) of the no_grad forwards run in training mode."""
        bad = [(s, sorted(on)) for s, grad, on in self.calls if not grad and on]
        return bad[0] if bad else (None, [])

    def counts(self) -> dict:
        train = [c for c in self.calls if c[1]]
        evals = [c for c in self.calls if not c[1]]
        full = set(self.mods)
        return {"training_forwards": len(train), "training_forwards_in_eval_mode": sum(c[2] != full for c in train),
                "eval_forwards": len(evals), "eval_forwards_in_train_mode": sum(bool(c[2]) for c in evals)}


class _ValidationCallback:
    """A Keras/Lightning-style on_step_end callback: every `every` steps, the validation loss under
    torch.no_grad() with the model in eval mode. restore: put the model back in training mode."""

    def __init__(self, model: nn.Module, val: tuple, every: int, restore: bool, set_eval: bool = True):
        self.model, self.val, self.every, self.restore, self.set_eval = model, val, every, restore, set_eval
        self.history: list[tuple[int, float]] = []

    def on_step_end(self, step: int) -> None:
        if (step + 1) % self.every:
            return
        if self.set_eval:
            self.model.eval()
        x, y = self.val
        with torch.no_grad():
            out = self.model(**x) if isinstance(x, dict) else self.model(x)
            logits = out.logits if hasattr(out, "logits") else out
            self.history.append((step, float(F.cross_entropy(logits, y))))
        if self.restore:
            self.model.train()


def _mode_oracle(modes: _Modes, which: str, planted: int, losses: list[float], **evidence) -> Oracle:
    step, where = modes.training_in_eval() if which == "train_in_eval" else modes.eval_in_train()
    assert step == planted and where, (step, planted, where)
    assert all(map(math.isfinite, losses)), losses[::5]
    return Oracle("train_eval_mode", step=step, where=where, step_tolerance=1 if which == "eval_in_train" else 2,
                  evidence={"what": which, **modes.counts(), "loss_first": losses[0],
                            "loss_last10": sum(losses[-10:]) / 10, **evidence})


@scenario("fresh_cnn_validation_callback_leaves_eval_mode", "cnn", "train_eval_mode", "mid",
          "a validation callback (on_step_end, every 20 steps) calls model.eval() and returns without "
          "model.train(): from step 20 on the CNN trains with BatchNorm on its running statistics and "
          "Dropout off (PyTorch docs, nn.Module.eval / train; Ioffe & Szegedy 2015; Srivastava et al. 2014)",
          fresh=True)
def fresh_cnn_validation_callback_leaves_eval_mode(run_dir: str) -> Oracle:
    g = seed_all(540)
    sample = _image_classes(g)
    norm = _channel_normaliser(sample)
    model = _SmallCNN()
    modes = _Modes(model)
    vx, vy = sample(64)
    cb = _ValidationCallback(model, (norm(vx), vy), every=20, restore=False)  # the bug: restore=False

    def batch(step):
        x, y = sample(32)
        return norm(x), y

    def after_step(step, loss):
        modes.step += 1
        cb.on_step_end(step)

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = record_loop(model, run_dir, batch, 60, opt, F.cross_entropy, after_step=after_step)
    return _mode_oracle(modes, "train_in_eval", 20, losses, validation=cb.history)


@scenario("fresh_bert_from_pretrained_custom_loop_eval_mode", "bert", "train_eval_mode", "init",
          "transformers' from_pretrained returns the model in evaluation mode ('The model is set in evaluation "
          "mode by default using model.eval() (Dropout modules are deactivated). To train the model, you "
          "should first set it back in training mode with model.train()', PreTrainedModel docs); a custom "
          "fine-tuning loop (no Trainer, which would call model.train()) never does", fresh=True)
def fresh_bert_from_pretrained_custom_loop_eval_mode(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(541)
    with tempfile.TemporaryDirectory() as d:  # the "pretrained" checkpoint: a tiny BERT saved, then loaded
        _bert(tf).save_pretrained(d)
        model = tf.BertForSequenceClassification.from_pretrained(d)
    assert not model.training
    modes = _Modes(model)
    data = _token_task(g)

    def batch(step):
        ids, y = data()
        return {"input_ids": ids, "labels": y}, None

    def after_step(step, loss):
        modes.step += 1

    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    losses = record_loop(model, run_dir, batch, 60, opt, after_step=after_step)
    return _mode_oracle(modes, "train_in_eval", 0, losses,
                        dropout_p=model.config.hidden_dropout_prob)


@scenario("fresh_vit_eval_loop_under_no_grad_in_train_mode", "vit", "train_eval_mode", "mid",
          "an evaluation loop that wraps the forward in torch.no_grad() but never calls model.eval(): no_grad "
          "is not eval mode (PyTorch docs, 'Autograd mechanics: evaluation mode (nn.Module.eval())'), so the "
          "ViT's Dropout stays on during validation and the validation accuracy is noisy and low", fresh=True)
def fresh_vit_eval_loop_under_no_grad_in_train_mode(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(542)
    model = _vit(tf, dropout=0.1)
    proc = tf.ViTImageProcessor(size={"height": 16, "width": 16})
    sample = _image_classes(g)
    modes = _Modes(model)
    vx, vy = sample(64)
    cb = _ValidationCallback(model, ({"pixel_values": proc(images=list(vx), return_tensors="pt").pixel_values}, vy),
                             every=20, restore=False, set_eval=False)  # the bug: no model.eval()

    def batch(step):
        x, y = sample(32)
        return {"pixel_values": proc(images=list(x), return_tensors="pt").pixel_values, "labels": y}, None

    def after_step(step, loss):
        modes.step += 1
        cb.on_step_end(step)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 70, opt, after_step=after_step)
    # The first evaluation runs after step 19's rec.step(): in the recorder's step 20.
    return _mode_oracle(modes, "eval_in_train", 20, losses, validation=cb.history)


@scenario("fresh_resnet_validation_in_train_mode_updates_bn_stats", "resnet", "train_eval_mode", "mid",
          "validation passes under torch.no_grad() with the ResNet left in training mode: BatchNorm normalises "
          "each validation batch by its own statistics and folds them into its running mean/var (Ioffe & "
          "Szegedy 2015; PyTorch BatchNorm2d docs: running stats are updated in training mode)", fresh=True)
def fresh_resnet_validation_in_train_mode_updates_bn_stats(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(543)
    model = tf.ResNetForImageClassification(tf.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=8))
    sample = _image_classes(g)
    norm = _channel_normaliser(sample)
    modes = _Modes(model)
    vx, vy = sample(64, noise=1.5)  # the held-out set: noisier pictures
    cb = _ValidationCallback(model, ({"pixel_values": norm(vx)}, vy), every=20, restore=False, set_eval=False)
    bn_name, bn = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d))
    shift: list[float] = []

    def batch(step):
        x, y = sample(32)
        return {"pixel_values": norm(x), "labels": y}, None

    def after_step(step, loss):
        modes.step += 1
        before = bn.running_var.clone()
        cb.on_step_end(step)
        if not torch.equal(before, bn.running_var):  # the validation batch moved the running stats
            shift.append(float((bn.running_var - before).abs().max()))

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = record_loop(model, run_dir, batch, 70, opt, after_step=after_step)
    assert len(shift) == len(cb.history) == 3, (shift, cb.history)
    return _mode_oracle(modes, "eval_in_train", 20, losses, validation=cb.history,
                        bn_running_var_moved_by_validation={bn_name: shift})


# -- input_data ----------------------------------------------------------------------------------

def _stats(x: torch.Tensor) -> dict:
    x = x.detach().float()
    return {"mean": float(x.mean()), "std": float(x.std()), "absmax": float(x.abs().max())}


@scenario("fresh_vit_pixel_values_skipped_image_processor", "vit", "input_data", "init",
          "a ViT fine-tuning script builds pixel_values straight from the decoded uint8 images "
          "(`torch.tensor(images).float()`) instead of through ViTImageProcessor, which rescales by 1/255 and "
          "normalises with mean 0.5, std 0.5 (transformers docs): the model gets 0..255 pixels", fresh=True)
def fresh_vit_pixel_values_skipped_image_processor(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(550)
    model = _vit(tf)
    proc = tf.ViTImageProcessor(size={"height": 16, "width": 16})
    sample = _image_classes(g)
    fed: list[dict] = []
    should: list[dict] = []

    def batch(step):
        x, y = sample(32)
        pixel_values = x.float()  # the bug: the processor skipped
        fed.append(_stats(pixel_values))
        should.append(_stats(proc(images=list(x), return_tensors="pt").pixel_values))
        return {"pixel_values": pixel_values, "labels": y}, None

    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    losses = record_loop(model, run_dir, batch, 60, opt)
    ratio = [f["std"] / s["std"] for f, s in zip(fed, should)]
    assert min(ratio) > 100 and min(f["mean"] for f in fed) > 50, (ratio[:3], fed[:3])
    return Oracle("input_data", step=0, where=[""], step_tolerance=2,
                  evidence={"fed_step0": fed[0], "processor_step0": should[0], "std_ratio_min": min(ratio),
                            "loss_first": losses[0], "loss_last10": sum(losses[-10:]) / 10})


@scenario("fresh_mlp_tabular_income_column_not_scaled", "mlp", "input_data", "init",
          "a tabular pipeline standardises the columns listed in NUMERIC_COLS, but 'income' (in dollars) was "
          "added to the features and not to that list: one input is ~1e4 x the others (LeCun et al. 1998, "
          "'Efficient BackProp', sec. 4.3: inputs of very different scales slow and destabilise learning)",
          fresh=True)
def fresh_mlp_tabular_income_column_not_scaled(run_dir: str) -> Oracle:
    g = seed_all(551)
    columns = ["age", "hours_per_week", "education_years", "tenure_years", "n_dependents", "income"]
    numeric_cols = columns[:5]  # the bug: "income" missing
    loc = torch.tensor([40.0, 40.0, 13.0, 6.0, 1.5, 0.0])
    scale = torch.tensor([12.0, 10.0, 3.0, 4.0, 1.2, 1.0])

    def raw(n):
        x = loc + scale * torch.randn(n, 6, generator=g)
        x[:, 5] = torch.exp(10.8 + 0.5 * torch.randn(n, generator=g))  # income, dollars (median ~49k)
        return x

    fit = raw(4096)  # the scaler's statistics, from the training set
    mu, sd = fit.mean(0), fit.std(0)
    scaled = torch.tensor([c in numeric_cols for c in columns])
    w = torch.tensor([0.8, 0.6, 1.0, 0.4, -0.5, 1.2])
    per_feature: list[list[float]] = []

    def batch(step):
        x = raw(64)
        z = (x - mu) / sd  # what the label depends on: every column standardised
        y = (z @ w + 0.5 * torch.randn(64, generator=g) > 0).long()
        fed = torch.where(scaled, (x - mu) / sd, x)
        per_feature.append(fed.std(0).tolist())
        return fed, y

    model = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, batch, 60, opt, F.cross_entropy)
    spread = [max(s) / min(s) for s in per_feature]
    assert min(spread) > 1e3, spread[:3]
    return Oracle("input_data", step=0, where=[""], step_tolerance=2,
                  evidence={"feature_std_step0": dict(zip(columns, per_feature[0])),
                            "max_over_min_feature_std_min": min(spread),
                            "loss_first": losses[0], "loss_last10": sum(losses[-10:]) / 10})


@scenario("fresh_cnn_corrupted_shard_zero_filled_batch", "cnn", "input_data", "mid",
          "a Dataset whose __getitem__ returns torch.zeros(3, H, W) when an image fails to decode (a common "
          "'skip bad samples' pattern); one shard is corrupt, so the batch of step 37 is all zeros", fresh=True)
def fresh_cnn_corrupted_shard_zero_filled_batch(run_dir: str) -> Oracle:
    g = seed_all(552)
    sample = _image_classes(g)
    norm = _channel_normaliser(sample)
    corrupt = 37
    seen: list[dict] = []

    def batch(step):
        x, y = sample(32)
        x = norm(x)
        if step == corrupt:  # every image of the corrupt shard failed to decode: zero-filled
            x = torch.zeros_like(x)
        seen.append(_stats(x))
        return x, y

    model = _SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = record_loop(model, run_dir, batch, 60, opt, F.cross_entropy)
    blank = [s for s, v in enumerate(seen) if v["absmax"] == 0]
    assert blank == [corrupt], blank
    return Oracle("input_data", step=corrupt, where=[""], step_tolerance=1,
                  evidence={"blank_steps": blank, "batch_before": seen[corrupt - 1], "batch_at": seen[corrupt],
                            "batch_after": seen[corrupt + 1], "loss_at": losses[corrupt],
                            "loss_median": statistics.median(losses)})


@scenario("fresh_rnn_second_site_shard_raw_units_shift", "rnn", "input_data", "mid",
          "dataset shift (Quinonero-Candela et al. 2009): from step 40 the loader reads a second site's shard, "
          "logged in K, Pa and fractions and not passed through the scaler fitted on the first site (degC, "
          "hPa, %): the GRU's inputs move by orders of magnitude for the rest of the run", fresh=True)
def fresh_rnn_second_site_shard_raw_units_shift(run_dir: str) -> Oracle:
    g = seed_all(553)
    length, change, steps = 24, 40, 80
    t = torch.arange(length).float()
    mean = torch.tensor([15.0, 1013.0, 60.0])  # degC, hPa, %: the scaler fitted on site A
    std = torch.tensor([5.0, 4.0, 12.0])

    def weather(n):
        y = torch.randint(0, 2, (n,), generator=g)  # 1: pressure falling (a storm coming)
        trend = (0.3 + 0.3 * torch.rand(n, generator=g)) * (1 - 2 * y.float())
        temp = 15 + 5 * torch.sin(0.26 * t[None] + 6.28 * torch.rand(n, 1, generator=g)) \
            + torch.randn(n, length, generator=g)
        pres = 1013 + 3 * torch.randn(n, 1, generator=g) + trend[:, None] * (t[None] - length / 2) \
            + 0.5 * torch.randn(n, length, generator=g)
        hum = 60 + 10 * torch.randn(n, 1, generator=g) + 3 * torch.randn(n, length, generator=g)
        return torch.stack([temp, pres, hum], -1), y

    seen: list[torch.Tensor] = []

    def batch(step):
        x, y = weather(32)
        if step < change:
            x = (x - mean) / std
        else:  # the bug: site B's shard, in other units, bypasses the scaler
            x = torch.stack([x[..., 0] + 273.15, x[..., 1] * 100, x[..., 2] / 100], -1)
        seen.append(x.mean((0, 1)))
        return x, y

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(3, 32, batch_first=True)
            self.head = nn.Linear(32, 2)

        def forward(self, x):
            return self.head(self.gru(x)[0][:, -1])

    model = Classifier()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = record_loop(model, run_dir, batch, steps, opt, F.cross_entropy)
    # The oracle: the batch mean per channel over the steps before the change (its mean and spread);
    # onset = the first step at which a channel's batch mean is > 20 of those spreads away; lasting:
    # every step from there on is.
    base = torch.stack(seen[:change])
    mu, spread = base.mean(0), base.std(0)
    away = [float(((m - mu).abs() / spread).max()) for m in seen]
    onset = first_step(away, lambda v: v > 20)
    assert onset == change and min(away[change:]) > 20 and max(away[:change]) < 5, (onset, away[change - 2:change + 2])
    return Oracle("input_data", step=onset, where=[""], step_tolerance=2,
                  evidence={"channel_means_before": mu.tolist(), "channel_means_after": seen[change].tolist(),
                            "max_deviation_before": max(away[:change]), "min_deviation_after": min(away[change:]),
                            "loss_before": sum(losses[change - 10:change]) / 10,
                            "loss_after": sum(losses[change:change + 10]) / 10})


# -- healthy look-alikes -------------------------------------------------------------------------

@scenario("fresh_vit_healthy_frozen_backbone_linear_probe", "vit", None, "healthy",
          "linear probing (Kumar et al. 2022; Kolesnikov et al. 2020's few-shot linear evaluation): the ViT "
          "encoder frozen (requires_grad=False) and only the classifier's parameters given to the optimizer, "
          "images through ViTImageProcessor", fresh=True)
def fresh_vit_healthy_frozen_backbone_linear_probe(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(560)
    model = _vit(tf)
    proc = tf.ViTImageProcessor(size={"height": 16, "width": 16})
    sample = _image_classes(g)
    for p in model.vit.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.classifier.parameters(), lr=1e-2)
    snap = _snapshot(model)

    def batch(step):
        x, y = sample(32)
        return {"pixel_values": proc(images=list(x), return_tensors="pt").pixel_values, "labels": y}, None

    losses = record_loop(model, run_dir, batch, 60, opt)
    never = _unchanged(model, snap)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert sorted(never) == sorted(frozen) and not (set(frozen) & _optimized(model, opt)), never
    return Oracle(None, evidence={"frozen": len(frozen), "trained": len(snap) - len(frozen), **_falls(losses, 0.8)})


@scenario("fresh_transformer_healthy_grad_accumulation_4", "transformer", None, "healthy",
          "intended gradient accumulation (transformers docs, 'gradient_accumulation_steps'; PyTorch forum "
          "recipe): 4 micro-batches, each loss divided by 4, backward each, then optimizer.step() and "
          "optimizer.zero_grad() once per 4 micro-batches; rec.step() once per optimizer step", fresh=True)
def fresh_transformer_healthy_grad_accumulation_4(run_dir: str) -> Oracle:
    from torchautopsy import Recorder

    g = seed_all(561)
    accum = 4
    data = _token_task(g, n=8)
    model = _TokenEncoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    tr = _Leftover(model)
    losses = []
    with Recorder(model, run_dir) as rec:
        for step in range(50):
            total = torch.zeros(())
            for micro in range(accum):
                ids, y = data()
                loss = F.cross_entropy(model(ids), y) / accum
                tr.before_backward()
                loss.backward()
                tr.after_backward()
                total = total + loss.detach()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # cleared after each optimizer step (HF Trainer's order)
            rec.step(loss=total)
            losses.append(float(total))
    first = tr.left[::accum]
    assert all(v == 0 for v in first) and all(v > 0 for i, v in enumerate(tr.left) if i % accum), tr.left[:8]
    return Oracle(None, evidence={"micro_batches": accum, **_falls(losses, 0.85)})


@scenario("fresh_cnn_healthy_validation_switches_eval_train", "cnn", None, "healthy",
          "the PyTorch tutorials' train/validate pattern: a validation callback every 20 steps calls "
          "model.eval(), evaluates under torch.no_grad(), and puts the model back with model.train(); "
          "images normalised with the dataset's channel means and stds", fresh=True)
def fresh_cnn_healthy_validation_switches_eval_train(run_dir: str) -> Oracle:
    g = seed_all(562)
    sample = _image_classes(g)
    norm = _channel_normaliser(sample)
    model = _SmallCNN()
    modes = _Modes(model)
    vx, vy = sample(64)
    cb = _ValidationCallback(model, (norm(vx), vy), every=20, restore=True)

    def batch(step):
        x, y = sample(32)
        return norm(x), y

    def after_step(step, loss):
        modes.step += 1
        cb.on_step_end(step)

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = record_loop(model, run_dir, batch, 60, opt, F.cross_entropy, after_step=after_step)
    assert modes.training_in_eval()[0] is None and modes.eval_in_train()[0] is None and len(cb.history) == 3
    return Oracle(None, evidence={**modes.counts(), "validation": cb.history, **_falls(losses, 0.8)})


@scenario("fresh_bert_healthy_token_ids_model_zero_grad", "bert", None, "healthy",
          "the transformers fine-tuning recipe in a custom loop: model.train(), model.zero_grad() at the top "
          "of each step, integer token ids as inputs, AdamW with linear warm-up and decay, gradient clipping "
          "at 1.0 (Devlin et al. 2019; transformers' get_linear_schedule_with_warmup)", fresh=True)
def fresh_bert_healthy_token_ids_model_zero_grad(run_dir: str) -> Oracle:
    from torchautopsy import Recorder

    tf = hf()
    g = seed_all(563)
    model = _bert(tf)
    data = _token_task(g)
    steps = 80
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = tf.get_linear_schedule_with_warmup(opt, 8, steps)
    tr = _Leftover(model)
    losses = []
    model.train()
    with Recorder(model, run_dir) as rec:
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            ids, y = data()
            loss = model(input_ids=ids, labels=y).loss
            tr.before_backward()
            loss.backward()
            tr.after_backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            rec.step(loss=loss)
            losses.append(float(loss.detach()))
    assert all(v == 0 for v in tr.left)
    return Oracle(None, evidence=_falls(losses, 0.85))


@scenario("fresh_bert_healthy_lora_frozen_base_optimizer_after", "bert", None, "healthy",
          "LoRA done as PEFT does it (Hu et al. 2021): base BERT frozen, adapters on query/value added "
          "first, the classifier trained too (modules_to_save), and the optimizer built afterwards over the "
          "trainable parameters only; the adapters' A matrices get an exactly zero gradient at step 0 (B "
          "starts at 0) and learn from step 1", fresh=True)
def fresh_bert_healthy_lora_frozen_base_optimizer_after(run_dir: str) -> Oracle:
    tf = hf()
    g = seed_all(564)
    model = _bert(tf)
    model.requires_grad_(False)
    lora = _add_lora(model)
    model.classifier.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = _token_task(g)
    snap = _snapshot(model)
    norms: list[dict] = []

    def batch(step):
        ids, y = data()
        return {"input_ids": ids, "labels": y}, None

    losses = record_loop(model, run_dir, batch, 80, opt, before_update=lambda s: norms.append(grad_norms(model)))
    never = _unchanged(model, snap)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert sorted(never) == sorted(frozen), sorted(set(never) ^ set(frozen))
    assert not (set(frozen) & _optimized(model, opt))
    a0 = [norms[0][n] for n in lora if "lora_A" in n]
    assert all(v == 0 for v in a0) and all(norms[-1][n] > 0 for n in lora), (a0, norms[-1])
    return Oracle(None, evidence={"adapters": len(lora), "frozen": len(frozen), **_falls(losses, 0.5)})


@scenario("fresh_mlp_healthy_zero_grad_set_to_none_false", "mlp", None, "healthy",
          "gradients cleared in place every step with optimizer.zero_grad(set_to_none=False) (the default "
          "before PyTorch 2.0, still written to keep the .grad tensors allocated): the same gradient tensors "
          "are reused each step, zeroed before each backward (torch.optim.Optimizer.zero_grad docs)", fresh=True)
def fresh_mlp_healthy_zero_grad_set_to_none_false(run_dir: str) -> Oracle:
    from torchautopsy import Recorder

    g = seed_all(565)
    w = torch.randn(12, generator=g)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tr = _Leftover(model)
    losses = []
    with Recorder(model, run_dir) as rec:
        for step in range(150):
            opt.zero_grad(set_to_none=False)
            x = torch.randn(64, 12, generator=g)
            y = (x @ w + 0.5 * torch.randn(64, generator=g) > 0).long()
            loss = F.cross_entropy(model(x), y)
            tr.before_backward()
            loss.backward()
            tr.after_backward()
            opt.step()
            rec.step(loss=loss)
            losses.append(float(loss.detach()))
    assert all(v == 0 for v in tr.left)
    return Oracle(None, evidence=_falls(losses, 0.6))
