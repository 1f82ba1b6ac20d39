"""Attention probabilities and per-head statistics, computed beside the real attention call.

The recorder never switches a model to another attention path (no ``need_weights=True`` forced on
``nn.MultiheadAttention``, no swapped SDPA backend): it re-derives the probabilities from the same
query and key, under ``torch.no_grad()``, on detached tensors, and lets the real call run untouched.
Everything here is pure math over tensors: no hooks, no state, no host synchronisation (no
``.item()``, no data-dependent Python branching), so the statistics stay on the device until the
recorder's one per-step host copy.

Functions
---------
``sdpa_probs(q, k, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, max_batch=4)``
    The probabilities ``torch.nn.functional.scaled_dot_product_attention`` uses (before dropout).
``mha_probs(module, query, key, key_padding_mask=None, attn_mask=None, is_causal=False, max_batch=4)``
    The per-head probabilities an ``nn.MultiheadAttention`` computes for these inputs.
``head_stats(probs, allowed=None)``
    Per head: normalised entropy, largest weight, sink share -> (H, 3).
``head_similarity(probs)``
    Mean pairwise cosine similarity of the heads' attention maps -> scalar.

Both ``*_probs`` functions return ``(B', H, L', S)`` with ``B' = min(batch, max_batch)``: only the
first ``max_batch`` batch elements are looked at (a slice, to cap the cost). With
``return_allowed=True`` they return ``(probs, allowed)`` where ``allowed`` is a boolean tensor
broadcastable to ``probs`` that says which keys each query row may attend to (False where a mask
put ``-inf``); pass it to ``head_stats`` so that entropy is normalised by the number of keys a row
may really attend to (a causal row ``i`` has ``i + 1`` keys, not ``S``).

Memory guard: when ``B' * H * L * S`` exceeds ``max_elements`` (default ``2**24`` elements, 64 MiB
in float32), only the first ``L' = max(1, max_elements // (B' * H * S))`` query rows are computed,
so ``probs.shape[2]`` may be smaller than the query length. (With a causal mask those first rows
see fewer keys than the average row; normalised entropy accounts for that when ``allowed`` is
passed, the sink share does not.)

Numerics: computed in float32 (float16/bfloat16 inputs are upcast; float64 inputs stay float64, so
oracle tests can be tight), with autocast switched off inside. Rows in which every key is masked
out have all-zero probabilities (SDPA's math path also returns 0 there; MHA's softmax gives NaN);
``head_stats`` ignores them. Non-finite queries/keys are NOT hidden: they give NaN probabilities and
NaN statistics, as the real call would.

Not supported (the functions return ``None``): nested-tensor inputs; an ``nn.MultiheadAttention``
called with ``is_causal=True`` but no ``attn_mask`` (torch itself raises for that call). For
``nn.MultiheadAttention`` with ``is_causal=True`` the given ``attn_mask`` is used, as torch does on
its ``need_weights=True`` path and its inference fast path; pass ``need_weights=False`` to follow
torch's other path, which drops ``attn_mask`` for a top-left causal mask when there is no
``key_padding_mask`` (the two agree whenever the hint is honest, as torch requires).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["sdpa_probs", "mha_probs", "head_stats", "head_stats_groups", "head_similarity",
           "head_similarity_groups", "DEFAULT_MAX_ELEMENTS"]

#: Largest probability tensor (elements) computed at once; beyond it fewer query rows are taken.
DEFAULT_MAX_ELEMENTS = 2 ** 24


# -- helpers --------------------------------------------------------------------------------------
def _compute_dtype(*tensors) -> torch.dtype:
    """float64 if any input is float64, else float32 (half inputs are upcast)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _no_autocast(device: torch.device):
    """A context that switches autocast off for ``device`` (so our float32 math stays float32)."""
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except (RuntimeError, ValueError, TypeError):  # a device type autocast does not know
        return contextlib.nullcontext()


def _first_batch(x: torch.Tensor, n_lead: int, n: int) -> torch.Tensor:
    """The first ``n`` elements of ``x``'s ``n_lead`` leading dims, flattened into one dim.

    Works on expanded (stride-0) views without materialising the whole broadcast tensor.
    """
    if n_lead == 0:
        return x.unsqueeze(0)
    if n_lead == 1:
        return x[:n]
    lead = x.shape[:n_lead]
    idx = torch.unravel_index(torch.arange(n, device=x.device), lead)
    return x[idx]


def _row_limit(b: int, h: int, l: int, s: int, max_elements: int) -> int:
    """How many query rows fit in the memory guard (at least one)."""
    per_row = max(1, b * h * s)
    if b * h * l * s <= max_elements:
        return l
    return max(1, min(l, max_elements // per_row))


def _softmax_with_allowed(scores: torch.Tensor):
    """Softmax over the last dim; rows whose keys are all -inf become zeros (not NaN).

    Returns ``(probs, allowed)``; ``allowed`` is False exactly where the score is -inf (masked).
    NaN scores count as allowed, so NaN inputs still give NaN probabilities.
    """
    allowed = scores != float("-inf")
    any_allowed = allowed.any(dim=-1, keepdim=True)
    # A fully masked row: replace its scores by zeros so softmax is finite, then zero the row.
    safe = torch.where(any_allowed, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
    probs = torch.softmax(safe, dim=-1)
    probs = probs * any_allowed.to(probs.dtype)
    return probs, allowed


# -- scaled_dot_product_attention -----------------------------------------------------------------
@torch.no_grad()
def sdpa_probs(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
               max_batch: int = 4, *, max_elements: int = DEFAULT_MAX_ELEMENTS,
               return_allowed: bool = False):
    """Attention probabilities as ``F.scaled_dot_product_attention(q, k, v, ...)`` uses them.

    q: ``(..., H, L, E)``, k: ``(..., Hk, S, E)`` (leading dims broadcast as SDPA's math path
    does; 3-D ``(N, L, E)`` inputs count as N batch elements of one head, 2-D ``(L, E)`` as one).
    attn_mask: bool (True = may attend, as in SDPA) or float (added to the scores), broadcastable
    to ``(..., H, L, S)``. is_causal: top-left lower-triangular mask
    ``torch.ones(L, S).tril(0)`` (combined with attn_mask if both are given, as in SDPA's
    reference implementation). scale: defaults to ``1 / sqrt(E)``. enable_gqa: the ``Hk`` key heads
    are repeated (``repeat_interleave`` on the head dim) to match the ``H`` query heads.

    Returns ``(B', H, L', S)`` probabilities before dropout (see the module docstring for B', L'),
    detached, float32 (float64 for float64 input). With ``return_allowed=True`` returns
    ``(probs, allowed)``. Returns None for nested tensors.
    """
    if getattr(q, "is_nested", False) or getattr(k, "is_nested", False):
        return None
    q = q.detach()
    k = k.detach()
    if attn_mask is not None:
        attn_mask = attn_mask.detach()
    dtype = _compute_dtype(q, k, attn_mask)
    L, E = q.shape[-2], q.shape[-1]
    S = k.shape[-2]

    rep = 1  # GQA: each key head serves `rep` query heads
    if enable_gqa and q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        hq, hk = q.shape[-3], k.shape[-3]
        if hk == 0 or hq % hk != 0:
            raise ValueError(f"enable_gqa: {hq} query heads are not a multiple of {hk} key heads")
        rep = hq // hk
        if q.dim() < 4 or k.dim() < 4:  # no batch dim to slice first: repeat now (small)
            k, rep = k.repeat_interleave(rep, dim=-3), 1

    # Common leading shape of the score tensor (..., L, S), broadcasting as matmul does.
    k_lead = k.shape[:-2] if rep == 1 else k.shape[:-3] + (k.shape[-3] * rep,)
    shapes = [q.shape[:-2], k_lead]
    if attn_mask is not None:
        shapes.append(attn_mask.shape[:-2])
    lead = tuple(torch.broadcast_shapes(*shapes))
    qx = q.expand(*lead, L, E)
    # with GQA, keys keep their Hk heads until the batch slice is taken (repeat only B' of them)
    kx = k.expand(*lead, S, E) if rep == 1 else k.expand(*lead[:-1], k.shape[-3], S, E)
    mx = attn_mask.expand(*lead, L, S) if attn_mask is not None else None
    # Give every input a head dim: 2-D (L, E) -> (1, 1, L, E); 3-D (N, L, E) -> (N, 1, L, E).
    while len(lead) < 2:  # a new head dim of size 1, just before (L, E)
        lead = lead + (1,)
        qx, kx = qx.unsqueeze(-3), kx.unsqueeze(-3)
        mx = mx.unsqueeze(-3) if mx is not None else None
    H = lead[-1]
    batch = math.prod(lead[:-1])
    nb = min(batch, max_batch)
    rows = _row_limit(nb, H, L, S, max_elements)

    with _no_autocast(q.device):
        qb = _first_batch(qx, len(lead) - 1, nb)[:, :, :rows].to(dtype)
        kb = _first_batch(kx, len(lead) - 1, nb).to(dtype)
        if rep != 1:
            kb = kb.repeat_interleave(rep, dim=1)
        sc = 1.0 / math.sqrt(E) if scale is None else float(scale)
        scores = torch.matmul(qb * sc, kb.transpose(-2, -1))  # (B', H, L', S)
        if is_causal:
            causal = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril(diagonal=0)
            scores = scores.masked_fill(~causal[:rows], float("-inf"))
        if mx is not None:
            mb = _first_batch(mx, len(lead) - 1, nb)[:, :, :rows]
            if mb.dtype == torch.bool:
                scores = scores.masked_fill(~mb, float("-inf"))
            else:
                scores = scores + mb.to(dtype)
        probs, allowed = _softmax_with_allowed(scores)
    return (probs, allowed) if return_allowed else probs


# -- nn.MultiheadAttention ------------------------------------------------------------------------
def _to_float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MHA's canonical mask: bool True -> -inf (NOT allowed), float -> added as is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError("only bool and floating masks are supported (as in nn.MultiheadAttention)")
    return mask.to(dtype)


@torch.no_grad()
def mha_probs(module: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
              key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
              is_causal: bool = False, max_batch: int = 4, *, need_weights: bool = True,
              max_elements: int = DEFAULT_MAX_ELEMENTS, return_allowed: bool = False):
    """The per-head attention probabilities ``module(query, key, value, ...)`` computes.

    Mirrors ``torch.nn.functional.multi_head_attention_forward``: projection with the module's
    own weights (``in_proj_weight``/``in_proj_bias``, or ``q_proj_weight``/``k_proj_weight`` when
    kdim/vdim differ), ``batch_first``, unbatched 2-D inputs, ``add_bias_kv`` (bias_k appended to
    the keys) and ``add_zero_attn`` (a zero key appended), scaling by ``1 / sqrt(head_dim)``.
    attn_mask: 2-D ``(L, S)`` or 3-D ``(N * num_heads, L, S)``; bool True = NOT allowed (the
    opposite of SDPA), float added. key_padding_mask: ``(N, S)`` or ``(S,)``; bool True = padding
    (ignored), float added. is_causal: a hint, as in torch; it requires attn_mask (returns None
    without it, where torch raises) and the mask is used (see the module docstring for
    ``need_weights=False``).

    Returns ``(B', H, L', S')`` (S' counts the bias_k / zero-attention keys), detached, float32
    (float64 for float64 inputs), before dropout; or ``(probs, allowed)`` with
    ``return_allowed=True``; None for the unsupported cases.
    """
    if getattr(query, "is_nested", False) or getattr(key, "is_nested", False):
        return None
    if is_causal and attn_mask is None:
        return None  # torch raises "Need attn_mask if specifying the is_causal hint"
    E = module.embed_dim
    H = module.num_heads
    hd = module.head_dim
    batched = query.dim() == 3
    query = query.detach()
    key = key.detach()
    # Work batch-first: (N, L, E) and (N, S, kdim).
    if not batched:
        query, key = query.unsqueeze(0), key.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    N, L, _ = query.shape
    S = key.shape[1]
    extra = int(module.bias_k is not None) + int(bool(module.add_zero_attn))
    S_total = S + extra

    if is_causal and key_padding_mask is None and not need_weights:
        # torch drops attn_mask and asks SDPA for a top-left causal mask
        attn_mask, causal = None, True
    else:
        causal = False

    dtype = _compute_dtype(query, key, attn_mask, key_padding_mask)
    nb = min(N, max_batch)
    rows = _row_limit(nb, H, L, S_total, max_elements)

    if module._qkv_same_embed_dim:
        w = module.in_proj_weight
        w_q, w_k = w[:E], w[E:2 * E]
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    b = module.in_proj_bias
    b_q, b_k = (None, None) if b is None else (b[:E], b[E:2 * E])

    dev = query.device
    with _no_autocast(dev):
        def lin(x, w, bias):
            return F.linear(x.to(dtype), w.detach().to(dtype),
                            None if bias is None else bias.detach().to(dtype))

        qp = lin(query[:nb, :rows], w_q, b_q)                   # (B', L', E)
        kp = lin(key[:nb], w_k, b_k)                            # (B', S, E)
        if module.bias_k is not None:
            bk = module.bias_k.detach().to(dtype).reshape(1, 1, E).expand(nb, 1, E)
            kp = torch.cat([kp, bk], dim=1)
        qh = qp.view(nb, qp.shape[1], H, hd).transpose(1, 2)    # (B', H, L', hd)
        kh = kp.view(nb, kp.shape[1], H, hd).transpose(1, 2)    # (B', H, S, hd)
        if module.add_zero_attn:
            kh = torch.cat([kh, torch.zeros(nb, H, 1, hd, dtype=dtype, device=kh.device)], dim=2)
        scores = torch.matmul(qh * math.sqrt(1.0 / float(hd)), kh.transpose(-2, -1))

        if attn_mask is not None:
            am = attn_mask.detach()  # slice before converting: only what we use is copied
            if am.dim() == 2:
                am = am[:rows].reshape(1, 1, -1, S)
            elif am.dim() == 3:
                am = am.reshape(-1, H, L, S)[:nb, :, :rows]
            else:
                raise ValueError(f"attn_mask's dimension {am.dim()} is not supported")
            am = _to_float_mask(am, dtype)
            if extra:
                am = F.pad(am, (0, extra))
            scores = scores + am
        if key_padding_mask is not None:
            kpm = _to_float_mask(key_padding_mask.detach()[:nb], dtype)
            if extra:
                kpm = F.pad(kpm, (0, extra))
            scores = scores + kpm.view(nb, 1, 1, S_total)
        if causal:
            tri = torch.ones(L, S_total, dtype=torch.bool, device=scores.device).tril(diagonal=0)
            scores = scores.masked_fill(~tri[:rows], float("-inf"))
        probs, allowed = _softmax_with_allowed(scores)
    return (probs, allowed) if return_allowed else probs


# -- statistics -----------------------------------------------------------------------------------
@torch.no_grad()
def head_stats(probs: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head statistics of ``(B, H, L, S)`` (or ``(H, L, S)``) probabilities -> ``(H, 3)``.

    On probs' device, in probs' dtype (float32 for half inputs); no host synchronisation.

    Columns:
      0. normalised entropy: mean over valid rows with >= 2 allowed keys of
         ``entropy(row) / log(allowed keys in the row)`` (1 = uniform, 0 = one key); NaN if no
         such row.
      1. max weight: mean over valid rows of the row's largest probability; NaN if no valid row.
      2. sink share: the share of all attention mass (summed over batch and valid rows) that lands
         on the single most-attended key position.

    A row is valid when it has at least one allowed key and its probabilities are not all zero
    (a fully masked row). ``allowed``: bool, broadcastable to probs, True where a row may attend
    to the key (``return_allowed=True`` of the ``*_probs`` functions); None = every key allowed.
    NaN probabilities propagate to NaN statistics.
    """
    p = probs if probs.dim() == 4 else probs.unsqueeze(0)
    return head_stats_groups(p.unsqueeze(0), allowed)[0]


@torch.no_grad()
def head_stats_groups(probs: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """head_stats of G calls at once: ``(G, B, H, L, S)`` probabilities (``allowed``
    broadcastable to them) -> ``(G, H, 3)``, a fixed number of ops whatever G."""
    p = probs.detach()
    if not torch.is_floating_point(p) or p.dtype in (torch.float16, torch.bfloat16):
        p = p.float()
    G, B, H, L, S = p.shape
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    if allowed is None:
        n_allowed = torch.full((1, 1, 1, 1), float(S), dtype=p.dtype, device=p.device)
    else:
        n_allowed = allowed.to(device=p.device).sum(dim=-1).to(p.dtype)  # broadcastable (.., L)
    row_sum = p.sum(dim=-1)                                               # (G, B, H, L)
    valid = ((row_sum != 0) & (n_allowed >= 1)).expand(G, B, H, L)       # NaN sums stay valid
    ent_ok = valid & (n_allowed >= 2)

    ent = torch.special.entr(p).sum(dim=-1)                               # 0 * log 0 = 0
    ent_norm = torch.where(ent_ok, ent / torch.log(torch.clamp(n_allowed, min=2.0)), zero)
    ent_mean = ent_norm.sum(dim=(1, 3)) / ent_ok.sum(dim=(1, 3)).to(p.dtype)   # 0/0 -> NaN

    mx = torch.where(valid, p.amax(dim=-1), zero) if S > 0 else torch.zeros_like(row_sum)
    max_mean = mx.sum(dim=(1, 3)) / valid.sum(dim=(1, 3)).to(p.dtype)

    mass = (p * valid.unsqueeze(-1).to(p.dtype)).sum(dim=(1, 3))          # (G, H, S)
    top = mass.amax(dim=-1) if S > 0 else torch.zeros_like(mass.sum(dim=-1))
    sink = top / mass.sum(dim=-1)                                          # 0/0 -> NaN
    return torch.stack([ent_mean, max_mean, sink], dim=-1)


@torch.no_grad()
def head_similarity(probs: torch.Tensor) -> torch.Tensor:
    """Mean pairwise cosine similarity between the heads' ``(B, L, S)`` maps -> scalar tensor.

    1 = all heads attend alike; NaN with fewer than two heads. An all-zero head map counts as
    similarity 0 to every other head.
    """
    p = probs if probs.dim() == 4 else probs.unsqueeze(0)
    return head_similarity_groups(p.unsqueeze(0))[0]


@torch.no_grad()
def head_similarity_groups(probs: torch.Tensor) -> torch.Tensor:
    """head_similarity of G calls at once: ``(G, B, H, L, S)`` -> ``(G,)``."""
    p = probs.detach()
    if not torch.is_floating_point(p) or p.dtype in (torch.float16, torch.bfloat16):
        p = p.float()
    G, H = p.shape[0], p.shape[2]
    if H < 2:
        return torch.full((G,), float("nan"), dtype=p.dtype, device=p.device)
    unit = F.normalize(p.transpose(1, 2).reshape(G, H, -1), dim=2, eps=1e-30 if p.dtype == torch.float64 else 1e-12)
    gram = unit @ unit.transpose(1, 2)
    off = gram.sum(dim=(1, 2)) - torch.diagonal(gram, dim1=1, dim2=2).sum(dim=-1)
    return off / (H * (H - 1))
