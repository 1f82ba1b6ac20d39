"""Oracle tests of recorder/forward/attention_math.py: the probabilities must be the ones torch itself uses.

MHA: compared with ``module(..., need_weights=True, average_attn_weights=False)[1]`` and, for the
``need_weights=False`` path, with the module's output rebuilt from our probabilities.
SDPA: ``probs @ v`` must reproduce ``F.scaled_dot_product_attention``'s output (float64, dropout 0).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from torchautopsy.recorder.forward.attention_math import head_similarity, head_stats, mha_probs, sdpa_probs

D = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=D):
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


def _mha(embed=8, heads=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(embed, heads, dropout=0.0, dtype=D, **kw)
    with torch.no_grad():  # non-zero biases, so that a wrong bias slice shows
        if m.in_proj_bias is not None:
            m.in_proj_bias.normal_()
    return m


def _oracle(m, q, k, v, **kw):
    out, w = m(q, k, v, need_weights=True, average_attn_weights=False, **kw)
    return w if w.dim() == 4 else w.unsqueeze(0)


# -- nn.MultiheadAttention -----------------------------------------------------------------------
@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_batched_matches_module(batch_first):
    m = _mha(batch_first=batch_first)
    B, L, S = 3, 5, 7
    shp = (lambda n: (B, n, 8)) if batch_first else (lambda n: (n, B, 8))
    q, k = _randn(*shp(L), seed=1), _randn(*shp(S), seed=2)
    v = _randn(*shp(S), seed=3)
    got = mha_probs(m, q, k)
    assert got.shape == (B, 2, L, S) and got.dtype == D
    torch.testing.assert_close(got, _oracle(m, q, k, v), **TOL)


def test_mha_self_attention_and_max_batch():
    m = _mha(batch_first=True)
    x = _randn(6, 4, 8, seed=1)
    want = _oracle(m, x, x, x)
    got = mha_probs(m, x, x, max_batch=2)
    assert got.shape == (2, 2, 4, 4)
    torch.testing.assert_close(got, want[:2], **TOL)


def test_mha_unbatched():
    m = _mha()
    q, k, v = _randn(5, 8, seed=1), _randn(6, 8, seed=2), _randn(6, 8, seed=3)
    kpm = torch.tensor([False, False, True, False, False, True])
    got = mha_probs(m, q, k, key_padding_mask=kpm)
    assert got.shape == (1, 2, 5, 6)
    torch.testing.assert_close(got, _oracle(m, q, k, v, key_padding_mask=kpm), **TOL)


def test_mha_kdim_vdim():
    m = _mha(embed=8, heads=4, kdim=5, vdim=3, batch_first=True)
    assert not m._qkv_same_embed_dim
    q, k, v = _randn(2, 4, 8, seed=1), _randn(2, 6, 5, seed=2), _randn(2, 6, 3, seed=3)
    torch.testing.assert_close(mha_probs(m, q, k), _oracle(m, q, k, v), **TOL)


def test_mha_no_bias():
    m = _mha(bias=False, batch_first=True)
    x = _randn(2, 5, 8, seed=1)
    torch.testing.assert_close(mha_probs(m, x, x), _oracle(m, x, x, x), **TOL)


def test_mha_key_padding_mask_bool_and_float():
    m = _mha(batch_first=True)
    q, k, v = _randn(3, 4, 8, seed=1), _randn(3, 6, 8, seed=2), _randn(3, 6, 8, seed=3)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    kpm[2, 1] = True
    got, allowed = mha_probs(m, q, k, key_padding_mask=kpm, return_allowed=True)
    torch.testing.assert_close(got, _oracle(m, q, k, v, key_padding_mask=kpm), **TOL)
    assert (got[0, :, :, 4:] == 0).all()
    assert torch.equal(allowed, (~kpm)[:, None, None, :].expand_as(allowed))
    fkpm = _randn(3, 6, seed=4)
    torch.testing.assert_close(mha_probs(m, q, k, key_padding_mask=fkpm),
                               _oracle(m, q, k, v, key_padding_mask=fkpm), **TOL)


def test_mha_attn_mask_bool_float_2d_3d():
    m = _mha(batch_first=True)
    B, H, L, S = 2, 2, 4, 5
    q, k, v = _randn(B, L, 8, seed=1), _randn(B, S, 8, seed=2), _randn(B, S, 8, seed=3)
    bool2 = torch.rand(L, S, generator=_gen(5)) < 0.3
    bool2[:, 0] = False  # MHA: True = NOT allowed; keep every row attending somewhere
    for mask in (bool2, _randn(L, S, seed=6), _randn(B * H, L, S, seed=7),
                 torch.rand(B * H, L, S, generator=_gen(8)) < 0.3):
        if mask.dtype == torch.bool:
            mask[..., 0] = False
        got = mha_probs(m, q, k, attn_mask=mask)
        torch.testing.assert_close(got, _oracle(m, q, k, v, attn_mask=mask), **TOL)
    # bool attn_mask and bool key_padding_mask together
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 3] = True
    torch.testing.assert_close(mha_probs(m, q, k, attn_mask=bool2, key_padding_mask=kpm),
                               _oracle(m, q, k, v, attn_mask=bool2, key_padding_mask=kpm), **TOL)


def test_mha_causal_mask():
    m = _mha(batch_first=True)
    x = _randn(2, 6, 8, seed=1)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=D)
    want = _oracle(m, x, x, x, attn_mask=causal, is_causal=True)
    got, allowed = mha_probs(m, x, x, attn_mask=causal, is_causal=True, return_allowed=True)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(allowed[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    bool_causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    torch.testing.assert_close(mha_probs(m, x, x, attn_mask=bool_causal), want, **TOL)
    # is_causal without attn_mask: torch raises; we decline
    assert mha_probs(m, x, x, is_causal=True) is None


def _mha_out_from_probs(m, probs, value_bf):
    """The module's output rebuilt from per-head probs (batch-first value, packed weights)."""
    E, H = m.embed_dim, m.num_heads
    vp = F.linear(value_bf, m.in_proj_weight[2 * E:], m.in_proj_bias[2 * E:])
    vh = vp.view(vp.shape[0], vp.shape[1], H, E // H).transpose(1, 2)
    o = (probs @ vh).transpose(1, 2).reshape(vp.shape[0], -1, E)
    return m.out_proj(o)


def test_mha_need_weights_false_path_matches_output():
    """TransformerEncoderLayer calls MHA with need_weights=False (SDPA inside): our probs
    must rebuild that output too, including the is_causal hint that drops attn_mask."""
    m = _mha(batch_first=True)
    m.train()
    x = _randn(2, 6, 8, seed=1)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=D)
    with torch.no_grad():
        out, _ = m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
        p = mha_probs(m, x, x, attn_mask=causal, is_causal=True, need_weights=False)
        torch.testing.assert_close(_mha_out_from_probs(m, p, x), out, **TOL)
        # a dishonest hint: torch (need_weights=False, no padding mask) ignores attn_mask
        zero = torch.zeros(6, 6, dtype=D)
        out2, _ = m(x, x, x, attn_mask=zero, is_causal=True, need_weights=False)
        p2 = mha_probs(m, x, x, attn_mask=zero, is_causal=True, need_weights=False)
        torch.testing.assert_close(_mha_out_from_probs(m, p2, x), out2, **TOL)
        torch.testing.assert_close(p2, p, **TOL)


def test_mha_inside_transformer_encoder_layer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=D)
    seen = {}

    def pre_hook(mod, args, kwargs):
        q, k = args[0], args[1]
        seen["p"] = mha_probs(mod, q, k, key_padding_mask=kwargs.get("key_padding_mask"),
                              attn_mask=kwargs.get("attn_mask"),
                              is_causal=kwargs.get("is_causal", False),
                              need_weights=kwargs.get("need_weights", True))
        seen["x"] = q

    h = layer.self_attn.register_forward_pre_hook(pre_hook, with_kwargs=True)
    x = _randn(2, 5, 8, seed=1)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    layer(x, src_key_padding_mask=kpm)
    h.remove()
    want = _oracle(layer.self_attn, seen["x"], seen["x"], seen["x"], key_padding_mask=kpm)
    torch.testing.assert_close(seen["p"], want, **TOL)


def test_mha_add_bias_kv_and_zero_attn():
    for kw in (dict(add_bias_kv=True), dict(add_zero_attn=True),
               dict(add_bias_kv=True, add_zero_attn=True)):
        m = _mha(batch_first=True, **kw)
        if m.bias_k is not None:
            with torch.no_grad():
                m.bias_k.normal_()
        q, k, v = _randn(2, 4, 8, seed=1), _randn(2, 5, 8, seed=2), _randn(2, 5, 8, seed=3)
        kpm = torch.zeros(2, 5, dtype=D)
        kpm[1, 0] = float("-inf")  # float, like attn_mask (torch warns on mixed mask types)
        am = _randn(4, 5, seed=4)
        got = mha_probs(m, q, k, key_padding_mask=kpm, attn_mask=am)
        assert got.shape[-1] == 5 + int("add_bias_kv" in kw) + int("add_zero_attn" in kw)
        torch.testing.assert_close(got, _oracle(m, q, k, v, key_padding_mask=kpm, attn_mask=am),
                                   **TOL)


def test_mha_float32_and_half_inputs_give_float32():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    got = mha_probs(m, x, x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _oracle(m, x, x, x), rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_ac = mha_probs(m, x, x)
    assert got_ac.dtype == torch.float32
    torch.testing.assert_close(got_ac, got, rtol=1e-6, atol=1e-7)


def test_mha_memory_guard_takes_first_rows():
    m = _mha(batch_first=True)
    x = _randn(3, 10, 8, seed=1)
    full = mha_probs(m, x, x)
    part = mha_probs(m, x, x, max_elements=3 * 2 * 10 * 4)
    assert part.shape == (3, 2, 4, 10)
    torch.testing.assert_close(part, full[:, :, :4], **TOL)
    am = torch.ones(3 * 2, 10, 10, dtype=torch.bool).triu(1)
    torch.testing.assert_close(mha_probs(m, x, x, attn_mask=am, max_elements=1),
                               mha_probs(m, x, x, attn_mask=am)[:, :, :1], **TOL)


# -- scaled_dot_product_attention ----------------------------------------------------------------
def _check_sdpa(q, k, v, **kw):
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    probs = sdpa_probs(q, k, **kw)
    assert not torch.isnan(probs).any()
    if kw.get("enable_gqa"):
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    lead = torch.broadcast_shapes(q.shape[:-2], v.shape[:-2])
    vx = v.expand(*lead, *v.shape[-2:])
    while vx.dim() < 4:
        vx = vx.unsqueeze(-3)
    vx = vx.reshape(-1, *vx.shape[-3:])[:probs.shape[0]]
    refx = ref.expand(*lead, *ref.shape[-2:])
    while refx.dim() < 4:
        refx = refx.unsqueeze(-3)
    refx = refx.reshape(-1, *refx.shape[-3:])[:probs.shape[0]]
    torch.testing.assert_close(probs @ vx, refx, **TOL)
    return probs


def test_sdpa_plain_4d():
    q, k, v = _randn(2, 3, 5, 4, seed=1), _randn(2, 3, 7, 4, seed=2), _randn(2, 3, 7, 6, seed=3)
    p = _check_sdpa(q, k, v)
    assert p.shape == (2, 3, 5, 7)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, 5, dtype=D), **TOL)


def test_sdpa_masks():
    q, k, v = _randn(2, 3, 5, 4, seed=1), _randn(2, 3, 7, 4, seed=2), _randn(2, 3, 7, 4, seed=3)
    bmask = torch.rand(5, 7, generator=_gen(4)) > 0.4
    bmask[:, 2] = True
    _check_sdpa(q, k, v, attn_mask=bmask)                          # 2-D bool, True = attend
    _check_sdpa(q, k, v, attn_mask=_randn(2, 1, 5, 7, seed=5))     # float, broadcast over heads
    _check_sdpa(q, k, v, attn_mask=_randn(3, 5, 7, seed=6))        # float, per head
    _check_sdpa(q, k, v, is_causal=True)
    _check_sdpa(q, k, v, scale=0.37)
    _check_sdpa(q, k, v, attn_mask=bmask, scale=2.0)
    p = _check_sdpa(q, k, v, is_causal=True, attn_mask=_randn(5, 7, seed=7))
    assert (p[..., 0, 1:] == 0).all()


def test_sdpa_causal_is_top_left_when_l_ne_s():
    q, k, v = _randn(1, 2, 3, 4, seed=1), _randn(1, 2, 6, 4, seed=2), _randn(1, 2, 6, 4, seed=3)
    p, allowed = sdpa_probs(q, k, is_causal=True, return_allowed=True)
    assert torch.equal(allowed[0, 0], torch.ones(3, 6, dtype=torch.bool).tril())
    _check_sdpa(q, k, v, is_causal=True)


def test_sdpa_gqa():
    q = _randn(2, 6, 5, 4, seed=1)
    k, v = _randn(2, 2, 7, 4, seed=2), _randn(2, 2, 7, 4, seed=3)
    p = _check_sdpa(q, k, v, enable_gqa=True)
    assert p.shape == (2, 6, 5, 7)
    _check_sdpa(q, k, v, enable_gqa=True, is_causal=True)
    _check_sdpa(q, k, v, enable_gqa=True, attn_mask=_randn(6, 5, 7, seed=4))
    p = _check_sdpa(_randn(3, 2, 4, 5, 4, seed=5), _randn(3, 2, 2, 7, 4, seed=6),
                    _randn(3, 2, 2, 7, 4, seed=7), enable_gqa=True)
    assert p.shape == (4, 4, 5, 7)
    _check_sdpa(q[0], k[0], v[0], enable_gqa=True)  # 3-D (H, L, E)


def test_sdpa_3d_2d_and_extra_batch_dims():
    q, k, v = _randn(4, 5, 4, seed=1), _randn(4, 7, 4, seed=2), _randn(4, 7, 4, seed=3)
    p = _check_sdpa(q, k, v)
    assert p.shape == (4, 1, 5, 7)  # 3-D: N batch elements of one head
    p = _check_sdpa(q[0], k[0], v[0], is_causal=True)
    assert p.shape == (1, 1, 5, 7)
    q5, k5, v5 = _randn(2, 3, 2, 5, 4, seed=4), _randn(2, 3, 2, 7, 4, seed=5), _randn(2, 3, 2, 7, 4, seed=6)
    p = _check_sdpa(q5, k5, v5, attn_mask=_randn(3, 1, 5, 7, seed=7))
    assert p.shape == (4, 2, 5, 7)  # batch (2, 3) flattened, first max_batch=4 kept
    # k broadcast over the batch (stride 0), mask with its own batch dim
    _check_sdpa(q5, k5[:1], v5[:1], attn_mask=_randn(2, 3, 2, 5, 7, seed=8))


def test_sdpa_max_batch_and_memory_guard():
    q, k = _randn(6, 2, 8, 4, seed=1), _randn(6, 2, 9, 4, seed=2)
    full = sdpa_probs(q, k, is_causal=True, max_batch=6)
    assert full.shape == (6, 2, 8, 9)
    torch.testing.assert_close(sdpa_probs(q, k, is_causal=True), full[:4], **TOL)
    part = sdpa_probs(q, k, is_causal=True, max_batch=1, max_elements=2 * 9 * 3)
    assert part.shape == (1, 2, 3, 9)
    torch.testing.assert_close(part, full[:1, :, :3], **TOL)


def test_sdpa_fully_masked_rows_are_zero_not_nan():
    q, k, v = _randn(1, 2, 4, 4, seed=1), _randn(1, 2, 5, 4, seed=2), _randn(1, 2, 5, 4, seed=3)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    p, allowed = sdpa_probs(q, k, attn_mask=mask, return_allowed=True)
    assert not torch.isnan(p).any()
    assert (p[:, :, 1] == 0).all() and not allowed[:, :, 1].any()
    # SDPA's math path also gives 0 there: the output still matches
    torch.testing.assert_close(p @ v, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), **TOL)
    stats = head_stats(p, allowed)
    rows = torch.cat([p[:, :, :1], p[:, :, 2:]], dim=2)
    torch.testing.assert_close(stats, head_stats(rows, torch.cat([allowed[:, :, :1], allowed[:, :, 2:]], 2)))


def test_sdpa_half_input_float32_output_and_nan_not_hidden():
    q, k = torch.randn(1, 2, 3, 4).half(), torch.randn(1, 2, 3, 4).half()
    p = sdpa_probs(q, k)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p, sdpa_probs(q.float(), k.float()))
    q2 = q.float().clone()
    q2[0, 0, 0, 0] = float("nan")
    p2 = sdpa_probs(q2, k.float())
    assert torch.isnan(p2[0, 0, 0]).all() and not torch.isnan(p2[0, 1]).any()


# -- statistics ----------------------------------------------------------------------------------
def test_head_stats_uniform():
    B, H, L, S = 2, 3, 4, 5
    p = torch.full((B, H, L, S), 1.0 / S)
    st = head_stats(p)
    assert st.shape == (H, 3)
    torch.testing.assert_close(st[:, 0], torch.ones(H))
    torch.testing.assert_close(st[:, 1], torch.full((H,), 1.0 / S))
    torch.testing.assert_close(st[:, 2], torch.full((H,), 1.0 / S))


def test_head_stats_one_hot_sink():
    p = torch.zeros(2, 3, 4, 5)
    p[..., 0] = 1.0
    st = head_stats(p)
    torch.testing.assert_close(st, torch.tensor([[0.0, 1.0, 1.0]] * 3))


def test_head_stats_ignores_fully_masked_rows_and_uses_allowed_counts():
    L = S = 4
    allowed = torch.ones(L, S, dtype=torch.bool).tril()            # causal
    p = allowed.double() / allowed.sum(-1, keepdim=True)          # uniform over allowed keys
    p = p.expand(1, 2, L, S).clone()
    allowed = allowed.expand(1, 2, L, S)
    st = head_stats(p, allowed)
    torch.testing.assert_close(st[:, 0], torch.ones(2, dtype=D))   # row 0 (1 key) excluded
    torch.testing.assert_close(st[:, 1], torch.full((2,), (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, dtype=D))
    # key 0 gets 1 + 1/2 + 1/3 + 1/4 of the total mass 4
    torch.testing.assert_close(st[:, 2], torch.full((2,), (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4, dtype=D))
    # add a fully masked row (all zeros, nothing allowed) to head 0 only: nothing changes
    p2 = torch.cat([p, torch.zeros(1, 2, 1, S, dtype=D)], dim=2)
    a2 = torch.cat([allowed, torch.zeros(1, 2, 1, S, dtype=torch.bool)], dim=2)
    torch.testing.assert_close(head_stats(p2, a2), st)
    torch.testing.assert_close(head_stats(p2), head_stats(p))       # zero rows ignored w/o mask too
    # a head with no valid rows: NaN, no error
    assert torch.isnan(head_stats(torch.zeros(1, 1, 3, 4))).all()


def test_head_stats_entropy_value():
    p = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=D).view(1, 1, 1, 4)
    ent = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    st = head_stats(p)
    torch.testing.assert_close(st[0, 0], torch.tensor(ent / math.log(4), dtype=D))
    allowed = torch.tensor([True, True, True, False]).view(1, 1, 1, 4)
    torch.testing.assert_close(head_stats(p, allowed)[0, 0], torch.tensor(ent / math.log(3), dtype=D))


def test_head_similarity():
    base = torch.softmax(_randn(2, 1, 4, 5, seed=1), -1)
    same = base.expand(2, 3, 4, 5)
    torch.testing.assert_close(head_similarity(same), torch.tensor(1.0, dtype=D))
    assert torch.isnan(head_similarity(base))
    a = torch.zeros(1, 2, 2, 2)
    a[0, 0, :, 0] = 1
    a[0, 1, :, 1] = 1
    torch.testing.assert_close(head_similarity(a), torch.tensor(0.0))
    assert head_similarity(same).dim() == 0


# -- never change the training -------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
        self.qk = nn.Linear(8, 16)
        self.head = nn.Linear(8, 3)
        self.probe = False
        self.collected = []

    def forward(self, x):
        h = self.embed(x)
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        if self.probe:
            p = mha_probs(self.mha, h, h, attn_mask=causal, is_causal=True, need_weights=False)
            self.collected += [head_stats(p), head_similarity(p)]
        a, _ = self.mha(h, h, h, attn_mask=causal, is_causal=True, need_weights=False)
        q, k = self.qk(a).view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2).chunk(2, dim=-1)
        v = a.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        if self.probe:
            p, allowed = sdpa_probs(q, k, is_causal=True, return_allowed=True)
            self.collected += [head_stats(p, allowed), head_similarity(p)]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        return self.head(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], 8)).mean(1)


def _train(probe: bool):
    torch.manual_seed(0)
    net = _Net()
    net.probe = probe
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(3):
        x, y = torch.randn(4, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
        losses.append(loss.detach())
    return losses, grads, [p.detach().clone() for p in net.parameters()], net.collected


def test_probes_leave_training_bit_identical():
    l0, g0, p0, _ = _train(False)
    l1, g1, p1, col = _train(True)
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for s0, s1 in zip(g0, g1) for a, b in zip(s0, s1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert col and all(t.grad_fn is None and not t.requires_grad for t in col)
    assert all(torch.isfinite(t).all() for t in col)
