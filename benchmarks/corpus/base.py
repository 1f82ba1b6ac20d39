"""The validation corpus's building blocks: a scenario is a short, real training run recorded by
the default Recorder, and an oracle that proves its pathology (or its health) without
torchautopsy, from the scenario's own measurements (gradient norms taken from ``p.grad``,
attention weights the model returns, units' activity seen by the scenario's own hooks, resident
memory, the loss).

Scenarios register with ``@scenario(...)``; ``benchmarks/score_corpus.py`` runs them (each in a
process of its own), analyzes the traces and scores the findings against the oracles. The split
into a tuning half and a held-out half is fixed by the scenario's name (``split()``), so that no
one chooses which cases a threshold is tuned on.
"""

from __future__ import annotations

import hashlib
import math
import resource
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

KINDS = ("exploding_gradients", "vanishing_gradients", "nonfinite", "dead_relu", "attention_collapse",
         "memory_leak", "params_not_learning", "missing_zero_grad", "train_eval_mode", "input_data")


# Oracle.where of a NaN/Inf born in the loss function (its forward or its backward), outside the
# model's modules: a right diagnosis says so and names no module (issue 22: "the NaN was born in
# the loss function: say so"); the model itself is accepted where it computes its own loss.
LOSS = "<loss>"


@dataclass
class Oracle:
    """What the scenario proved, measured without torchautopsy.

    kind: the finding kind that must be reported (None: a healthy run, nothing of severity
    warning or error may be). step: the first step the pathology holds. where: the modules or
    parameters a finding may name (any one of them is right; names as named_modules() /
    named_parameters() spell them; a parameter matches its module and a module its parameters).
    step_tolerance: how far the reported step may be from `step`, given what the recorder
    samples (per-step figures: 0-2; module statistics on watched steps: ~10; activity windows:
    ~50). evidence: the oracle's numbers."""

    kind: str | None
    step: int | None = None
    where: list[str] = field(default_factory=list)
    step_tolerance: int = 0
    evidence: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    family: str  # mlp, cnn, resnet, rnn, transformer, gpt2, bert, vit, autoencoder
    kind: str | None  # the pathology it is built to show (None: a healthy control)
    onset: str  # "init" (present from the first step), "mid" (arises during training), "healthy"
    source: str  # where the pathology is described: a paper, a tutorial, a bug report
    run: Callable[[str], Oracle]  # trains and records into the run directory given
    fresh: bool = False  # written after the thresholds were tuned: held out from everything


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, family: str, kind: str | None, onset: str, source: str, fresh: bool = False):
    """Register the decorated function (run_dir -> Oracle) as a scenario. fresh: one of the
    scenarios written after the first held-out half had been seen (split "fresh")."""
    assert kind is None or kind in KINDS, kind
    assert onset in ("init", "mid", "healthy") and (onset == "healthy") == (kind is None), (name, onset)

    def register(fn):
        assert name not in SCENARIOS, f"two scenarios named {name}"
        SCENARIOS[name] = Scenario(name, family, kind, onset, source, fn, fresh)
        return fn

    return register


def split(name: str) -> str:
    """'tune' or 'holdout', fixed by the name (a hash): thresholds are tuned on one half only.
    'fresh': a scenario written by other hands after the held-out half's numbers had been seen
    while a rule was tried, so that the rules changed since are judged on cases no one tuned on."""
    if name in SCENARIOS and SCENARIOS[name].fresh:
        return "fresh"
    return "tune" if hashlib.sha256(name.encode()).digest()[0] % 2 == 0 else "holdout"


# -- what scenarios share ------------------------------------------------------------------------

def seed_all(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    return torch.Generator().manual_seed(seed + 1000)


def hf():
    """The transformers module, its warnings and progress bars silenced."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def image_templates(g: torch.Generator, size: int, n_cls: int = 8):
    """Synthetic image classification: each class a smooth random 3 x size x size template;
    returns sample(n, noise) -> (images, labels)."""
    import torch.nn.functional as F

    tpl = F.avg_pool2d(torch.randn(n_cls, 3, size + 4, size + 4, generator=g), 5, 1)
    tpl = tpl / tpl.std()

    def sample(n: int, noise: float):
        y = torch.randint(0, n_cls, (n,), generator=g)
        return tpl[y] + noise * torch.randn(n, 3, size, size, generator=g), y

    return sample


def rss_mib() -> float:
    """Resident memory now (Linux), MiB: the memory oracle's reading, not the recorder's."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def grad_norms(model: nn.Module) -> dict[str, float]:
    """Each parameter's gradient norm, from p.grad (the gradient oracle)."""
    return {n: float(p.grad.detach().float().norm()) if p.grad is not None else math.nan
            for n, p in model.named_parameters()}


def first_step(values: Iterable, pred) -> int | None:
    """The index of the first value for which pred holds (None if none)."""
    for i, v in enumerate(values):
        if pred(v):
            return i
    return None


class Activity:
    """Which units of the given modules' outputs were ever positive over each window of steps:
    the dead-unit oracle, by forward hooks of the scenario's own (outputs' last dim, or dim 1
    of a 4-D conv output, are the units)."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.seen: dict[str, torch.Tensor] = {}
        self.history: dict[str, list[float]] = {n: [] for n in modules}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(module, args, out):
            if not (module.training and torch.is_grad_enabled()):
                return
            with torch.no_grad():
                x = out.detach()
                alive = (x > 0).flatten(2).any(-1).any(0) if x.dim() == 4 else (x > 0).reshape(-1, x.shape[-1]).any(0)
                prev = self.seen.get(name)
                self.seen[name] = alive if prev is None else (prev | alive)
        return hook

    def end_window(self) -> None:
        """Close a window: each module's share of units never active in it."""
        for n in self.history:
            alive = self.seen.get(n)
            self.history[n].append(math.nan if alive is None else 1.0 - float(alive.float().mean()))
        self.seen.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def attention_entropy(probs: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """Mean entropy of attention rows normalised by log(number of keys each row may attend to)
    (1: uniform over what is allowed, 0: one-hot). probs: (..., queries, keys); valid: bool of
    the same shape, the keys each query may attend to (causal or padding masks), or None."""
    p = probs.detach().double().clamp_min(0)
    n_keys = (valid.sum(-1) if valid is not None else torch.full(p.shape[:-1], p.shape[-1])).double()
    h = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    ok = n_keys > 1
    return float((h[ok] / torch.log(n_keys[ok])).mean())


def record_loop(model: nn.Module, run_dir: str, batch: Callable[[int], tuple], steps: int, opt,
                loss_fn: Callable = None, before_update: Callable[[int], None] | None = None,
                after_step: Callable[[int, float], None] | None = None, clip: float | None = None,
                scheduler=None, **options) -> list[float]:
    """The usual loop, recorded with the default Recorder (options: any Recorder option a
    scenario needs, none by default). batch(step) -> (inputs, targets); inputs a tensor, a tuple
    (positional) or a dict (keyword); loss_fn(output, targets) -> loss (default: the output's
    own .loss, as Hugging Face models give). before_update(step): the oracle's look at the
    gradients; after_step(step, loss): its look at anything else. Returns the losses."""
    from torchautopsy import Recorder

    losses = []
    with Recorder(model, run_dir, **options) as rec:
        for step in range(steps):
            x, y = batch(step)
            out = model(**x) if isinstance(x, dict) else model(*x) if isinstance(x, tuple) else model(x)
            loss = out.loss if loss_fn is None else loss_fn(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if before_update is not None:
                before_update(step)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if scheduler is not None:
                scheduler.step()
            rec.step(loss=loss)
            value = float(loss.detach())
            losses.append(value)
            if after_step is not None:
                after_step(step, value)
    return losses
