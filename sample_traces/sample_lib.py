"""Helpers of make_samples.py: synthetic data sets and the small models. Reading a trace back and
the measurements that fix the ground truth of a case are in sample_truth.py.

Everything random takes an explicit seed: data through its own ``torch.Generator``, initial weights
through ``torch.manual_seed`` right before the model is built.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


N_IN = 16
BATCH = 64


# -- data ---------------------------------------------------------------------------------------

def teacher_regression(seed: int, n: int = 4096):
    """Inputs x ~ N(0, 1) and targets y = teacher(x) + noise, standardised (a learnable task
    with a noise floor, so the loss flattens out rather than going to zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_IN, generator=g)
    torch.manual_seed(seed + 1000)
    teacher = nn.Sequential(nn.Linear(N_IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        y = teacher(x)
        y = (y - y.mean()) / y.std()
    y = y + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def batches(n: int, seed: int, batch: int = BATCH):
    """Mini-batches of indices drawn uniformly (with replacement), from their own generator."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, n, (batch,), generator=g)


def gratings(n: int, seed: int, size: int = 16, noise: float = 0.5, raw: bool = False):
    """n grey images (1 x size x size) of sinusoidal gratings; the class (0-3) is the orientation
    (0, 45, 90, 135 degrees, +-9 degrees of jitter), with random spatial frequency and phase, plus
    Gaussian pixel noise. Standardised over the data set, or with raw=True pixel values in [0, 1]
    (as decoded from 8-bit images: (value + 3) / 6 clipped)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    theta = y.float() * (math.pi / 4) + 0.15 * torch.randn(n, generator=g)
    freq = 0.25 + 0.35 * torch.rand(n, generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g)
    c = torch.arange(size).float() - (size - 1) / 2
    yy, xx = torch.meshgrid(c, c, indexing="ij")
    proj = xx[None] * torch.cos(theta)[:, None, None] + yy[None] * torch.sin(theta)[:, None, None]
    img = torch.sin(freq[:, None, None] * proj + phase[:, None, None])[:, None]
    x = img + noise * torch.randn(n, 1, size, size, generator=g)
    if raw:
        return ((x + 3) / 6).clamp(0, 1), y
    return (x - x.mean()) / x.std(), y


PAD = 0


def count_task(n: int, seed: int, length: int = 16, vocab: int = 16, label_noise: float = 0.0):
    """Token sequences (ids 1..vocab-1, uniform); label 1 if token 1 occurs more often than token 2.
    A share `label_noise` of the labels is flipped (annotation noise: the loss has a floor)."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(1, vocab, (n, length), generator=g)
    y = ((tok == 1).sum(1) > (tok == 2).sum(1)).long()
    flip = torch.rand(n, generator=g) < label_noise
    return tok, torch.where(flip, 1 - y, y)


def ragged_count_task(n: int, seed: int, max_len: int = 16, vocab: int = 16, min_len: int = 4):
    """The count task on sequences of random length (min_len..max_len): a list of 1-D token tensors."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    seqs = [torch.randint(1, vocab, (int(L),), generator=g) for L in lengths]
    y = torch.tensor([int((s == 1).sum() > (s == 2).sum()) for s in seqs])
    return seqs, y


def waves(n: int, seed: int, length: int = 50):
    """Noisy sine waves (n x length x 1); the class (0-3) is the frequency (2, 3, 4 or 5 cycles per
    sequence), with random phase and amplitude (0.5-1.5) and Gaussian noise of std 0.5."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    t = torch.arange(length).float() / length
    amp = 0.5 + torch.rand(n, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    x = amp * torch.sin(2 * math.pi * (y[:, None].float() + 2) * t + phase)
    x = x + 0.5 * torch.randn(n, length, generator=g)
    return x[..., None], y


# -- models -------------------------------------------------------------------------------------

def relu_mlp(seed: int, width: int = 64, n_in: int = N_IN) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(
        fc1=nn.Linear(n_in, width), relu1=nn.ReLU(),
        fc2=nn.Linear(width, width), relu2=nn.ReLU(),
        fc3=nn.Linear(width, width), relu3=nn.ReLU(),
        out=nn.Linear(width, 1),
    ))


def small_cnn(seed: int, batchnorm: bool) -> nn.Module:
    """conv-(BN)-ReLU x4 with one max-pool, global average pooling, a linear 4-class head."""
    torch.manual_seed(seed)
    layers, c_in = [], 1
    for i, c in enumerate((16, 16, 32, 32), start=1):
        layers.append((f"conv{i}", nn.Conv2d(c_in, c, 3, padding=1, bias=not batchnorm)))
        if batchnorm:
            layers.append((f"bn{i}", nn.BatchNorm2d(c)))
        layers.append((f"relu{i}", nn.ReLU()))
        if i == 2:
            layers.append(("pool", nn.MaxPool2d(2)))
        c_in = c
    layers += [("gap", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()), ("fc", nn.Linear(c_in, 4))]
    return nn.Sequential(OrderedDict(layers))


class EncoderClassifier(nn.Module):
    """Token + learned position embeddings, nn.TransformerEncoder (post-LN, PyTorch's default),
    mean pooling over positions, a linear head."""

    def __init__(self, vocab: int = 16, length: int = 16, d: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(length, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(tok) + self.pos).mean(1))


class HandwrittenAttention(nn.Module):
    """Multi-head self-attention written out by hand, as many research code bases do: padded keys
    get a score of -inf before the softmax."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D // self.heads)
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


class SDPAAttention(HandwrittenAttention):
    """The same attention through torch.nn.functional.scaled_dot_product_attention (bool mask,
    True = may attend)."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.proj(out.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)) (GELU MLP)."""

    def __init__(self, d: int, heads: int, attention: type):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), keep)
        return x + self.mlp(self.ln2(x))


class PaddedTransformer(nn.Module):
    """Classifier over padded token sequences (PAD = 0) with a key padding mask `keep` (True =
    real token). pooling "mean": mean over the real tokens; "cls": the output at position 0."""

    def __init__(self, attention: type, pooling: str, vocab: int = 16, max_len: int = 17, d: int = 32,
                 heads: int = 4, layers: int = 2):
        super().__init__()
        self.pooling = pooling
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Parameter(0.1 * torch.randn(max_len, d))
        self.blocks = nn.ModuleList(Block(d, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tok: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok) + self.pos[: tok.shape[1]]
        for block in self.blocks:
            x = block(x, keep)
        x = self.ln_f(x)
        if self.pooling == "cls":
            return self.head(x[:, 0])
        k = keep[..., None].to(x.dtype)
        return self.head((x * k).sum(1) / k.sum(1).clamp(min=1.0))


class GRUClassifier(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])
