"""More MLP scenarios (family "mlp"): plain multilayer perceptrons on synthetic data, each a short
real training run whose pathology (or health) the scenario proves from its own measurements."""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from .base import LOSS, Activity, Oracle, first_step, grad_norms, record_loop, rss_mib, scenario, seed_all


# -- synthetic data ------------------------------------------------------------------------------

def _regression(g: torch.Generator, n_in: int = 16, batch: int = 64):
    """A fixed random teacher: y = tanh(x . w) + noise."""
    w = torch.randn(n_in, 1, generator=g) / math.sqrt(n_in)

    def make(step: int):
        x = torch.randn(batch, n_in, generator=g)
        return x, torch.tanh(x @ w) + 0.05 * torch.randn(batch, 1, generator=g)

    return make


def _classes(g: torch.Generator, n_in: int = 16, n_cls: int = 8, batch: int = 64, centre_scale: float = 1.5):
    """Gaussian clusters around fixed random centres: a learnable n_cls-way classification."""
    centres = centre_scale * torch.randn(n_cls, n_in, generator=g)

    def make(step: int):
        y = torch.randint(n_cls, (batch,), generator=g)
        return centres[y] + torch.randn(batch, n_in, generator=g), y

    return make


def _mlp(dims: list[int], act) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


# -- exploding gradients -------------------------------------------------------------------------

@scenario("mlp_tanh_chaotic_init", "mlp", "exploding_gradients", "init",
          "Poole et al. 2016 'Exponential expressivity in deep neural networks through transient chaos'; "
          "Schoenholz et al. 2017 'Deep information propagation': tanh nets with sigma_w^2 chi_1 > 1 "
          "(ordered/chaotic transition) have gradients growing exponentially towards the input")
def mlp_tanh_chaotic_init(run_dir: str) -> Oracle:
    g = seed_all(10)
    depth, width, sigma_w = 20, 64, 4.0  # sigma_w = 4 is deep in the chaotic phase (edge of chaos: ~1)
    model = _mlp([16] + [width] * depth + [1], nn.Tanh)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, sigma_w / math.sqrt(m.in_features))
            nn.init.zeros_(m.bias)
    lin = _linear_names(model)
    first, last_hidden = lin[0], lin[-2]
    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    record_loop(model, run_dir, _regression(g), 60, opt, F.mse_loss,
                before_update=lambda s: norms.append(grad_norms(model)))
    # Definition: exploding = the first hidden layer's weight-gradient norm exceeds the last hidden
    # layer's by more than 1e3 (the gradient grows by chi_1^(1/2) per layer going down). The
    # step is the first such step.
    ratios = [n[f"{first}.weight"] / n[f"{last_hidden}.weight"] for n in norms]
    step = first_step(ratios, lambda r: r > 1e3)
    assert step == 0, ratios[:5]
    # At fault: the layers whose weight gradient at that step is > 100x the last hidden layer's.
    ref = norms[step][f"{last_hidden}.weight"]
    where = [n for n in lin[:-1] if norms[step][f"{n}.weight"] > 100 * ref]
    return Oracle("exploding_gradients", step=step, where=where, step_tolerance=1,
                  evidence={"first_over_last_hidden_grad_ratio_step0": ratios[0],
                            "grad_norm_first_step0": norms[0][f"{first}.weight"],
                            "grad_norm_last_hidden_step0": ref,
                            "median_ratio": statistics.median(ratios)})


@scenario("mlp_lr_spike_diverges", "mlp", "exploding_gradients", "mid",
          "Goodfellow, Bengio & Courville 2016 'Deep Learning' sec. 8.2.4 / 10.11.1 (too-large steps "
          "overshoot and gradients grow); a scheduler bug multiplying the lr by 100 at a stage boundary")
def mlp_lr_spike_diverges(run_dir: str) -> Oracle:
    g = seed_all(11)
    model = _mlp([16, 64, 64, 64, 1], nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    spike = 150
    norms: list[dict] = []

    def before_update(step):
        norms.append(grad_norms(model))
        if step == spike - 1:  # from step `spike` on the lr is 100x (lr 1.0 instead of 0.01)
            for group in opt.param_groups:
                group["lr"] = 1.0

    # The run is stopped (as a person watching the loss would) a few steps after the spike, before
    # the divergence overflows into NaN.
    losses = record_loop(model, run_dir, _regression(g), spike + 7, opt, F.mse_loss, before_update=before_update)
    total = [math.sqrt(sum(v * v for v in n.values())) for n in norms]
    base = max(total[spike - 50:spike])
    # Definition: the first step (from 50 steps before the spike on) whose total gradient norm
    # exceeds 100x the largest of the 50 steps before the spike.
    step = first_step(range(len(total)), lambda i: i >= spike - 50 and not total[i] <= 100 * base)
    assert step is not None and step >= spike and all(map(math.isfinite, total + losses)), total[spike - 2:]
    # At fault: every parameter whose own gradient norm there exceeds 100x its own largest in the
    # 50 steps before the spike.
    where = [n for n in norms[0] if not norms[step][n] <= 100 * max(x[n] for x in norms[spike - 50:spike])]
    return Oracle("exploding_gradients", step=step, where=where, step_tolerance=1,
                  evidence={"max_grad_norm_50_before": base, "grad_norm_at_step": total[step],
                            "grad_norm_last": total[-1], "loss_last": losses[-1],
                            "loss_before": losses[spike - 1], "loss_at_step": losses[step],
                            "spike_step": spike})


# -- vanishing gradients -------------------------------------------------------------------------

@scenario("mlp_deep_sigmoid_vanishing", "mlp", "vanishing_gradients", "init",
          "Glorot & Bengio 2010 'Understanding the difficulty of training deep feedforward neural "
          "networks'; Hochreiter 1991: sigmoid'(x) <= 1/4, so a deep sigmoid stack with standard "
          "init shrinks the gradient geometrically towards the input")
def mlp_deep_sigmoid_vanishing(run_dir: str) -> Oracle:
    g = seed_all(12)
    depth = 10
    model = _mlp([16] + [64] * depth + [8], nn.Sigmoid)  # PyTorch's default Linear init
    lin = _linear_names(model)
    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = record_loop(model, run_dir, _classes(g), 150, opt, F.cross_entropy,
                         before_update=lambda s: norms.append(grad_norms(model)))
    # Definition: vanishing = the first layer's weight-gradient norm below 1e-4 x the output
    # layer's. The step is the first such step; it must hold on every step of the run.
    ratios = [n[f"{lin[0]}.weight"] / n[f"{lin[-1]}.weight"] for n in norms]
    step = first_step(ratios, lambda r: r < 1e-4)
    assert step == 0 and max(ratios) < 1e-4, (ratios[:3], max(ratios))
    # At fault: the layers whose weight gradient is < 1e-3 x the output layer's at that step.
    out = norms[step][f"{lin[-1]}.weight"]
    where = [n for n in lin if norms[step][f"{n}.weight"] < 1e-3 * out]
    return Oracle("vanishing_gradients", step=step, where=where, step_tolerance=1,
                  evidence={"first_over_output_grad_ratio_step0": ratios[0], "max_ratio": max(ratios),
                            "grad_norm_first_step0": norms[0][f"{lin[0]}.weight"], "grad_norm_output_step0": out,
                            "loss_first": losses[0], "loss_last": losses[-1]})


@scenario("mlp_tanh_saturates_after_lr_jump", "mlp", "vanishing_gradients", "mid",
          "LeCun et al. 1998 'Efficient BackProp' sec. 4.4/4.7 (large weights drive sigmoid units into "
          "saturation, where the gradient vanishes and learning stalls); Glorot & Bengio 2010 "
          "(saturated units); here an lr jump throws the weights into tanh's flat tails")
def mlp_tanh_saturates_after_lr_jump(run_dir: str) -> Oracle:
    g = seed_all(18)
    depth = 6
    model = _mlp([16] + [64] * depth + [8], nn.Tanh)
    for m in model:
        if isinstance(m, nn.Linear) and m.out_features == 64:
            nn.init.xavier_normal_(m.weight, gain=5 / 3)  # the recommended tanh init: trains well
            nn.init.zeros_(m.bias)
    lin = _linear_names(model)
    jump, steps = 150, 300

    def before_update(step):
        norms.append(grad_norms(model))
        if step == jump - 1:  # from step `jump` on the lr is 10.0 instead of 0.05 (a config typo)
            for group in opt.param_groups:
                group["lr"] = 10.0

    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = record_loop(model, run_dir, _classes(g, centre_scale=1.0), steps, opt, F.cross_entropy,
                         before_update=before_update)
    ratios = [n[f"{lin[0]}.weight"] / n[f"{lin[-1]}.weight"] for n in norms]
    # Definition: vanishing = the first layer's weight-gradient norm below 1e-4 x the output
    # layer's, on that step and on >= 95% of the later ones (the lower layers are stuck: their
    # units sit in tanh's flat tails; a rare batch still finds a unit off the tails). The step is
    # the first step from which that holds.
    step = first_step(range(steps), lambda i: ratios[i] < 1e-4
                      and sum(r < 1e-4 for r in ratios[i:]) >= 0.95 * (steps - i))
    assert min(ratios[:jump]) > 0.1, min(ratios[:jump])  # healthy before the jump
    assert step is not None and step > jump and steps - step >= 50, (step, ratios[jump:jump + 40])
    # The loss is stuck far above where it was: not convergence, a stall.
    assert min(losses[step:]) > 10 * max(losses[jump - 20:jump]), (min(losses[step:]), losses[jump - 20:jump])
    # At fault: the layers whose gradient is below 1e-3 x the output layer's on >= 95% of the
    # steps from that step on.
    where = [n for n in lin[:-1]
             if sum(x[f"{n}.weight"] < 1e-3 * x[f"{lin[-1]}.weight"] for x in norms[step:]) >= 0.95 * (steps - step)]
    return Oracle("vanishing_gradients", step=step, where=where, step_tolerance=2,
                  evidence={"ratio_median_before_jump": statistics.median(ratios[:jump]),
                            "ratio_median_after_step": statistics.median(ratios[step:]),
                            "share_of_later_steps_below_1e-4": sum(r < 1e-4 for r in ratios[step:]) / (steps - step),
                            "loss_before_jump": losses[jump - 1], "loss_min_after_step": min(losses[step:]),
                            "grad_norm_output_at_step": norms[step][f"{lin[-1]}.weight"], "jump_step": jump})


# -- non-finite values ---------------------------------------------------------------------------

@scenario("mlp_neglog_softmax_underflow", "mlp", "nonfinite", "mid",
          "a hand-written -log(softmax(z)[y]) instead of log_softmax / cross_entropy: softmax "
          "underflows to exactly 0 once a logit gap exceeds ~104 in float32, and log(0) = -inf "
          "(PyTorch docs of LogSoftmax / NLLLoss; Goodfellow et al. 2016 sec. 4.1)")
def mlp_neglog_softmax_underflow(run_dir: str) -> Oracle:
    g = seed_all(13)
    model = _mlp([16, 64, 64, 8], nn.ReLU)
    data = _classes(g)
    bad = 120  # rows of a shard whose features were not standardised (raw units) enter here

    def batch(step):
        x, y = data(step)
        if step == bad:
            x = x.clone()
            x[:8] = 5000.0 + 1000.0 * x[:8]  # raw = mean + std * standardised
        return x, y

    seen = {"logits_finite": [], "loss_finite": []}

    def loss_fn(logits, y):
        p = F.softmax(logits, dim=-1)
        loss = -torch.log(p.gather(1, y[:, None])).mean()  # the bug: -log(softmax) by hand
        seen["logits_finite"].append(bool(torch.isfinite(logits).all()))
        seen["loss_finite"].append(bool(torch.isfinite(loss)))
        return loss

    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record_loop(model, run_dir, batch, 150, opt, loss_fn, before_update=lambda s: norms.append(grad_norms(model)))
    # Definition: the first step whose loss is non-finite while the logits that the model gave the
    # loss were finite: the +inf is born in the loss function (log of an underflowed 0), not in a
    # module. Its backward (softmax of -inf) makes every gradient NaN in that same backward pass;
    # the first parameters to get it are the output layer's (backward runs from the loss).
    step = first_step(seen["loss_finite"], lambda ok: not ok)
    assert step == bad and seen["logits_finite"][step], (step, seen["logits_finite"][step or 0])
    out = _linear_names(model)[-1]
    assert not math.isfinite(norms[step][f"{out}.weight"])
    return Oracle("nonfinite", step=step, where=[LOSS], step_tolerance=0,
                  evidence={"first_nonfinite_loss_step": step, "logits_finite_then": True,
                            "grad_norm_out_weight_then": str(norms[step][f"{out}.weight"])})


@scenario("mlp_siamese_sqrt_zero_distance", "mlp", "nonfinite", "mid",
          "contrastive loss (Hadsell, Chopra & LeCun 2006) with a hand-written Euclidean distance "
          "sqrt(sum((a-b)^2)): d sqrt/dx = inf at 0, so a pair of identical inputs gives 0*inf = NaN "
          "gradients (pytorch/pytorch#2421-style reports; PyTorch autograd FAQ on sqrt at 0)")
def mlp_siamese_sqrt_zero_distance(run_dir: str) -> Oracle:
    g = seed_all(14)
    model = _mlp([16, 64, 64, 8], nn.ReLU)  # the embedding net, shared by both sides
    data = _classes(g, batch=32)
    dup = 100  # a de-duplication bug pairs a record with itself from here on, once

    def batch(step):
        x1, y1 = data(step)
        x2, y2 = data(step)
        if step == dup:
            x2 = x2.clone()
            x2[0], y2[0] = x1[0], y1[0]
        return torch.cat([x1, x2]), (y1 == y2).float()

    seen = {"loss_finite": [], "emb_finite": []}

    def loss_fn(emb, same):
        a, b = emb.chunk(2)
        d = torch.sqrt(((a - b) ** 2).sum(-1))  # the bug: no eps inside the sqrt
        loss = (same * d ** 2 + (1 - same) * F.relu(2.0 - d) ** 2).mean()
        seen["loss_finite"].append(bool(torch.isfinite(loss)))
        seen["emb_finite"].append(bool(torch.isfinite(emb).all()))
        return loss

    norms: list[dict] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    record_loop(model, run_dir, batch, 130, opt, loss_fn, before_update=lambda s: norms.append(grad_norms(model)))
    # Definition: the first step at which a parameter's gradient is non-finite. The forward pass
    # (embeddings and loss) is finite there; the NaN is born in the loss function's backward
    # (sqrt at 0). Backward reaches the output layer first, so its parameters are the first
    # whose gradient went non-finite (all the others follow in the same pass).
    step = first_step(norms, lambda n: not all(map(math.isfinite, n.values())))
    assert step == dup and seen["loss_finite"][step] and seen["emb_finite"][step], step
    out = _linear_names(model)[-1]
    assert not math.isfinite(norms[step][f"{out}.weight"])
    return Oracle("nonfinite", step=step, where=[LOSS], step_tolerance=0,
                  evidence={"first_nonfinite_grad_step": step, "loss_finite_then": True,
                            "grad_norm_out_weight_then": str(norms[step][f"{out}.weight"])})


# -- dead ReLUs ----------------------------------------------------------------------------------

@scenario("mlp_dead_relu_negative_bias_init", "mlp", "dead_relu", "init",
          "CS231n notes (Karpathy), 'Neural Networks Part 1: dying ReLU' — a unit whose "
          "pre-activation is negative for every input never fires and gets no gradient; here "
          "the hidden layer's bias is initialised to a large negative constant")
def mlp_dead_relu_negative_bias_init(run_dir: str) -> Oracle:
    g = seed_all(15)
    model = _mlp([16, 64, 128, 1], nn.ReLU)
    nn.init.constant_(model[2].bias, -4.0)  # the bug: the 2nd hidden layer's pre-activation ~ N(-4, 0.25^2)
    act = Activity({"1": model[1], "3": model[3]})
    window = 10

    def after_step(step, loss):
        if (step + 1) % window == 0:
            act.end_window()

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = record_loop(model, run_dir, _regression(g), 200, opt, F.mse_loss, after_step=after_step)
    act.remove()
    dead = act.history["3"]
    # Definition: a unit is dead in a window (10 steps) when it was never positive on any input of
    # it; the layer is dead when >= 90% of its units are. The step is the first step of the first
    # such window; it must hold in every window.
    w = first_step(dead, lambda share: share >= 0.9)
    assert w == 0 and min(dead) >= 0.9, dead
    assert max(act.history["1"]) < 0.2, act.history["1"]  # the first hidden layer is alive
    return Oracle("dead_relu", step=0, where=["3", "2"], step_tolerance=50,
                  evidence={"dead_share_layer3_per_window": dead[:5], "min_dead_share": min(dead),
                            "dead_share_layer1_max": max(act.history["1"]),
                            "loss_first": losses[0], "loss_last": losses[-1]})


# -- memory leak ---------------------------------------------------------------------------------

@scenario("mlp_stash_features_with_graph", "mlp", "memory_leak", "mid",
          "PyTorch FAQ 'My model reports cuda runtime error(2): out of memory' — don't accumulate "
          "history across the training loop; here a debugging hook keeps every batch's hidden "
          "features (not detached) in a list from an epoch boundary on")
def mlp_stash_features_with_graph(run_dir: str) -> Oracle:
    g = seed_all(16)
    model = _mlp([16, 512, 512, 1], nn.ReLU)
    data = _regression(g, batch=512)
    start, steps = 80, 220
    stash: list[torch.Tensor] = []
    state = {"step": 0}

    def hook(module, args, out):
        if state["step"] >= start and torch.is_grad_enabled():
            stash.append(out)  # the bug: no .detach(), never cleared (1 MiB a step)

    model[3].register_forward_hook(hook)
    rss: list[float] = []

    def after_step(step, loss):
        rss.append(rss_mib())
        state["step"] = step + 1

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    record_loop(model, run_dir, data, steps, opt, F.mse_loss, after_step=after_step)
    # Definition: the leak holds from the first step whose resident memory exceeds the highest
    # reading of all steps before it by more than 0.5 MiB and from which it never falls back,
    # growing by >= 100 MiB by the end. (The first stashed tensors reuse memory the allocator
    # already held, so resident memory starts to climb some steps after the first one kept.)
    plateau = max(rss[10:start])
    step = first_step(range(len(rss)),
                      lambda i: i >= 10 and min(rss[i:]) > max(rss[:i]) + 0.5 and rss[i] > plateau + 0.5)
    growth = rss[-1] - plateau
    assert step is not None and start <= step <= start + 40 and growth > 100, (step, growth, rss[start - 3:start + 5])
    return Oracle("memory_leak", step=step, where=[], step_tolerance=50,
                  evidence={"rss_plateau_mib": plateau, "rss_last_mib": rss[-1], "growth_mib": growth,
                            "growth_per_step_mib": growth / (steps - start), "stash_start_step": start,
                            "rss_at_start": rss[start - 1:start + 3]})


# -- healthy control -----------------------------------------------------------------------------

@scenario("mlp_healthy_dropout_wd_clip", "mlp", None, "healthy",
          "the usual regularised recipe: dropout (Srivastava et al. 2014), decoupled weight decay "
          "(Loshchilov & Hutter 2019), gradient-norm clipping (Pascanu et al. 2013)")
def mlp_healthy_dropout_wd_clip(run_dir: str) -> Oracle:
    g = seed_all(17)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 128), nn.ReLU(),
                          nn.Dropout(0.2), nn.Linear(128, 8))
    act = Activity({"1": model[1], "4": model[4]})
    norms: list[dict] = []

    def after_step(step, loss):
        if (step + 1) % 50 == 0:
            act.end_window()

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    losses = record_loop(model, run_dir, _classes(g), 250, opt, F.cross_entropy, clip=1.0,
                         before_update=lambda s: norms.append(grad_norms(model)), after_step=after_step)
    act.remove()
    total = [math.sqrt(sum(v * v for v in n.values())) for n in norms]
    dead = max(max(h) for h in act.history.values())
    # The oracle of health: the loss falls clearly, everything finite, gradients neither blow up
    # nor vanish (within 100x of their start), few units never active in a 50-step window.
    assert all(map(math.isfinite, losses + total))
    assert sum(losses[-20:]) < 0.3 * sum(losses[:20]), losses[::25]
    assert max(total) < 100 * total[0] and min(total) > 1e-3 * total[0], (max(total), min(total), total[0])
    assert dead < 0.2, act.history
    return Oracle(None, evidence={"loss_first": losses[0], "loss_last": losses[-1], "grad_norm_max": max(total),
                                  "grad_norm_min": min(total), "max_dead_share": dead})
