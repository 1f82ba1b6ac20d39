"""The non-finite cases of make_samples.py: a bad record reaches an operation undefined on it.
nan_birth (log of -1), nan_cnn_std (0/0 in a per-image standardisation) and nan_attention_mask
(softmax over -inf only) go non-finite in a module's forward; nan_backward_sqrt stays finite
forward and goes NaN in the backward pass of sqrt at 0. Step and module are fixed by construction
(the constants below) and checked against the trace.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from cases_common import _train
from sample_lib import (BATCH, N_IN, PAD, HandwrittenAttention, PaddedTransformer, gratings,
                        ragged_count_task, small_cnn)
from sample_truth import read_trace

# ---------------------------------------------------------------------------------------------
# Ground truth known by construction.
# nan_birth: the corrupted record (a -1 "missing value" in a feature that log() expects positive)
# is placed in the batch of this step, so the first non-finite forward output is at this step,
# produced by this module (its name as model.named_modules() spells it).
NAN_BIRTH_STEP = 60
NAN_BIRTH_MODULE = "features.log"
# nan_cnn_std: a blank (all-zero) frame lands in the batch of this step; per-image standardisation
# divides its zero deviation by its zero standard deviation.
NAN_CNN_STEP = 45
NAN_CNN_MODULE = "standardize"
# nan_attention_mask: an empty sequence (every key padded) lands in the batch of this step; the
# hand-written masked softmax of the first block's attention gets a row of -inf only.
NAN_ATTN_STEP = 70
NAN_ATTN_MODULE = "blocks.0.attn"
# ---------------------------------------------------------------------------------------------


# -- non-finite values ----------------------------------------------------------------------------

def _nan_entry(case: str, run_dir: str, step: int, module: str, cause: str) -> dict:
    t = read_trace(run_dir)
    origin = t["nonfinite_origin"]
    hit = np.nonzero(origin >= 0)[0]
    first = int(hit[0]) if len(hit) else None
    name = t["module_names"][origin[first]] if first is not None else None
    bad_loss = np.nonzero(~np.isfinite(t["loss"]))[0]
    print(f"  steps/nonfinite_origin first >= 0 at step {first}: module {name!r} "
          f"(expected step {step}, {module!r}); first non-finite loss at step "
          f"{int(bad_loss[0]) if len(bad_loss) else None}; batch_nonfinite at that step = "
          f"{int(t['batch_nonfinite'][first]) if first is not None else None}")
    print(f"  loss before: step 0 {t['loss'][0]:.3f}, step {step - 1} {t['loss'][step - 1]:.3f}")
    if first != step or name != module:
        raise SystemExit(f"{case}: the trace says step {first}, module {name!r}; expected "
                         f"step {step}, module {module!r}")
    if not np.all(np.isfinite(t["loss"][:step])):
        raise SystemExit(f"{case}: non-finite loss before the NaN step")
    return {"kind": "nonfinite", "step": step, "where": [module], "evidence": {"cause": cause}}


class LogFeatures(nn.Module):
    """log() of raw, positive features (counts, prices, durations): the usual log transform,
    done inside the model. A record with a non-positive value makes it produce NaN (or -Inf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def nan_birth(run_dir: str) -> dict:
    n_steps = 100
    g = torch.Generator().manual_seed(5)
    logx = torch.randn(n_steps * BATCH, N_IN, generator=g)
    raw = torch.exp(logx)  # log-normal raw features, all > 0
    torch.manual_seed(1005)
    teacher = nn.Sequential(nn.Linear(N_IN, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        y = teacher(logx)
        y = (y - y.mean()) / y.std()
    y = y + 0.1 * torch.randn(len(y), 1, generator=g)
    # One record of the batch of step NAN_BIRTH_STEP has a missing value stored as -1 by the
    # upstream export. The data is read in order (no shuffling), one batch per step.
    raw[NAN_BIRTH_STEP * BATCH + 37, 5] = -1.0

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        features=nn.Sequential(OrderedDict(log=LogFeatures(), proj=nn.Linear(N_IN, 64))),
        body=nn.Sequential(OrderedDict(act1=nn.ReLU(), fc=nn.Linear(64, 64), act2=nn.ReLU())),
        head=nn.Linear(64, 1),
    ))
    assert NAN_BIRTH_MODULE in dict(model.named_modules())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        return (raw[step * BATCH:(step + 1) * BATCH],), y[step * BATCH:(step + 1) * BATCH]

    _train(model, run_dir, n_steps, batch, F.mse_loss, opt)
    return _nan_entry("nan_birth", run_dir, NAN_BIRTH_STEP, NAN_BIRTH_MODULE,
                      "log(-1): a missing value stored as -1 in record "
                      f"{NAN_BIRTH_STEP * BATCH + 37}, feature 5")


class PerImageStandardize(nn.Module):
    """Per-image standardisation, (x - mean) / std over each image's pixels (a common first layer
    for camera data), written without the epsilon / minimum std that guards a constant image."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        return (x - mean) / x.std(dim=(1, 2, 3), keepdim=True)


def nan_cnn_std(run_dir: str) -> dict:
    """Raw grating frames (pixel values in [0, 1]), standardised per image inside the model, then the
    4-conv ReLU CNN; Adam 1e-3, 80 steps, one shuffled epoch. One frame is blank (all zeros: a
    camera dropout / failed decode); it lands in the batch of step NAN_CNN_STEP, where its
    standardisation is 0 / 0 = NaN."""
    n_steps = 80
    x, y = gratings(n_steps * BATCH, seed=13, raw=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(14))  # one epoch, shuffled
    blank = int(order[NAN_CNN_STEP * BATCH + 11])
    x[blank] = 0.0
    model = nn.Sequential(OrderedDict(standardize=PerImageStandardize(),
                                      cnn=small_cnn(seed=0, batchnorm=False)))
    assert NAN_CNN_MODULE in dict(model.named_modules())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        idx = order[step * BATCH:(step + 1) * BATCH]
        return (x[idx],), y[idx]

    _train(model, run_dir, n_steps, batch, F.cross_entropy, opt)
    return _nan_entry("nan_cnn_std", run_dir, NAN_CNN_STEP, NAN_CNN_MODULE,
                      f"0/0: frame {blank} is blank (all pixels 0), its per-image standard deviation is 0")


def _pad_batch(seqs: list[torch.Tensor]):
    tok = pad_sequence(seqs, batch_first=True, padding_value=PAD)
    return tok, tok != PAD


def nan_attention_mask(run_dir: str) -> dict:
    """A 2-block pre-LN transformer with hand-written attention (scores of padded keys set to -inf
    before the softmax) classifies variable-length token sequences (the count task), masked mean
    pooling (guarded against length 0), Adam 1e-3, batch 32, 100 steps, one shuffled epoch. One
    document is empty (every token was filtered out upstream); in the batch of step NAN_ATTN_STEP its
    attention rows are all -inf and softmax gives 0/0 = NaN."""
    n_steps, bs = 100, 32
    seqs, y = ragged_count_task(n_steps * bs, seed=51)
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(52))
    empty = int(order[NAN_ATTN_STEP * bs + 5])
    seqs[empty] = seqs[empty][:0]
    torch.manual_seed(0)
    model = PaddedTransformer(HandwrittenAttention, pooling="mean")
    assert NAN_ATTN_MODULE in dict(model.named_modules())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        idx = order[step * bs:(step + 1) * bs]
        return _pad_batch([seqs[i] for i in idx]), y[idx]

    _train(model, run_dir, n_steps, batch, F.cross_entropy, opt)
    return _nan_entry("nan_attention_mask", run_dir, NAN_ATTN_STEP, NAN_ATTN_MODULE,
                      f"softmax over a row of -inf only: document {empty} is empty, every key of it is padding")


class Siamese(nn.Module):
    """Embeds both records of a pair with one ReLU MLP and returns their Euclidean distance,
    written as sqrt(sum of squares): finite for identical records (0), but its derivative there is
    1 / (2 sqrt(0)) = Inf, and the backward pass multiplies it by 0."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(OrderedDict(
            fc1=nn.Linear(N_IN, 64), relu1=nn.ReLU(), fc2=nn.Linear(64, 64), relu2=nn.ReLU(),
            out=nn.Linear(64, 8)))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((self.embed(a) - self.embed(b)) ** 2).sum(dim=1))


NAN_BACKWARD_STEP = 55
NAN_BACKWARD_WHERE = ["embed.out.weight", "embed.out.bias"]


def nan_backward_sqrt(run_dir: str) -> dict:
    """Metric learning: a Siamese ReLU MLP trained with the contrastive loss (Hadsell et al. 2006,
    same * d^2 + (1 - same) * relu(2 - d)^2) on pairs of records from 8 clusters, read in order,
    Adam 1e-3, 100 steps. One "same" pair in the batch of step NAN_BACKWARD_STEP is a duplicated
    record (a = b): its distance is exactly 0, the forward pass and the loss stay finite, and the
    backward pass of sqrt gives 0 * Inf = NaN. The NaN enters through the last layer's parameters
    (the first the backward pass reaches), then every gradient, then every weight (Adam)."""
    n_steps = 100
    n = n_steps * BATCH
    g = torch.Generator().manual_seed(71)
    centers = 2.0 * torch.randn(8, N_IN, generator=g)
    ca = torch.randint(0, 8, (n,), generator=g)
    same = (torch.rand(n, generator=g) < 0.5)
    cb = torch.where(same, ca, (ca + torch.randint(1, 8, (n,), generator=g)) % 8)
    a = centers[ca] + 0.5 * torch.randn(n, N_IN, generator=g)
    b = centers[cb] + 0.5 * torch.randn(n, N_IN, generator=g)
    dup = NAN_BACKWARD_STEP * BATCH + 9
    same[dup] = True
    b[dup] = a[dup]  # the same record twice (a duplicate in the export)
    target = same.float()
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn(d, same):
        return (same * d ** 2 + (1 - same) * F.relu(2.0 - d) ** 2).mean()

    def batch(step):
        s = slice(step * BATCH, (step + 1) * BATCH)
        return (a[s], b[s]), target[s]

    _train(model, run_dir, n_steps, batch, loss_fn, opt)
    t = read_trace(run_dir)
    bad = t["nonfinite_origin"] >= 0
    gbad = ~np.isfinite(t["grad_norm"]).all(axis=1)
    first_g = int(np.flatnonzero(gbad)[0]) if gbad.any() else None
    first_f = int(np.flatnonzero(bad)[0]) if bad.any() else None
    print(f"  first non-finite gradient at step {first_g} (expected {NAN_BACKWARD_STEP}); loss there "
          f"{t['loss'][NAN_BACKWARD_STEP]:.4g} (finite); first non-finite forward output at step {first_f} "
          f"(the weights went NaN in that step's update)")
    if first_g != NAN_BACKWARD_STEP or not np.isfinite(t["loss"][:NAN_BACKWARD_STEP + 1]).all() or \
            (first_f is not None and first_f <= NAN_BACKWARD_STEP):
        raise SystemExit("nan_backward_sqrt: the NaN did not appear first in the backward pass of step "
                         f"{NAN_BACKWARD_STEP}")
    return {"kind": "nonfinite", "step": NAN_BACKWARD_STEP, "where": NAN_BACKWARD_WHERE, "evidence": {
        "stage": "backward",
        "cause": f"sqrt'(0) = Inf times 0: pair {dup} is one record twice, distance exactly 0",
        "loss_at_step": float(t["loss"][NAN_BACKWARD_STEP]),
        "first_nonfinite_forward_step": first_f,
    }}
