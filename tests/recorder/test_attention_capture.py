"""The attention statistics a recording holds, against the same statistics computed from each
call's own arguments and the module's weights (attention_math.py's functions, tested against torch in
test_attention_math.py): an nn.MultiheadAttention inside nn.TransformerEncoderLayer (which calls
it with need_weights=False: the probabilities come from its scaled_dot_product_attention call),
one called directly (need_weights=True: recomputed beside it), and one on torch's fused path,
which calls no scaled_dot_product_attention (recomputed after the call)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from torchautopsy import Recorder
from torchautopsy.recorder.forward.attention_math import head_similarity, head_stats, mha_probs

from recorder_testlib import names, open_trace


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fused = nn.MultiheadAttention(16, 4, batch_first=True)  # frozen, eval: torch's fused path
        self.fused.requires_grad_(False)
        self.fused.eval()

    def forward(self, x, mask):
        h = self.layer(x, src_key_padding_mask=mask)
        a, _ = self.mha(h, x, x, key_padding_mask=mask)  # need_weights=True (the default)
        b, _ = self.fused(x, x, x, need_weights=False)
        return (a + b).mean(1)


def test_recorded_attention_matches_each_call_recomputed(tmp_path, monkeypatch):
    import torchautopsy.recorder.forward.attention_capture as capture

    recomputed = []  # the modules whose probabilities the recorder recomputed from their weights
    real = capture.mha_probs
    monkeypatch.setattr(capture, "mha_probs", lambda m, *a, **k: recomputed.append(m) or real(m, *a, **k))
    torch.manual_seed(0)
    net = _Net()
    seen = {}  # module name -> its call's (args, kwargs)
    for name in ("layer.self_attn", "mha", "fused"):
        net.get_submodule(name).register_forward_pre_hook(
            lambda m, a, k, name=name: seen.setdefault(name, (a, dict(k))), with_kwargs=True)
    x = torch.randn(6, 10, 16)
    mask = torch.zeros(6, 10, dtype=torch.bool)
    mask[:, 8:] = True  # the last two positions are padding
    with Recorder(net, tmp_path / "run") as rec:  # step 0 is watched
        net(x, mask).pow(2).mean().backward()
        rec.step()

    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        modules = names(f["modules/name"])
        sites = {modules[m]: (src.decode(), int(h), int(off), i) for i, (m, src, h, off) in enumerate(zip(
            f["attention_sites/module"][:], f["attention_sites/source"][:], f["attention_sites/heads"][:],
            f["attention_sites/head_offset"][:]))}
        assert set(sites) == {"layer.self_attn", "mha", "fused"}
        # The encoder layer's from its own scaled_dot_product_attention call, not recomputed.
        assert recomputed == [net.mha, net.fused]
        assert f["attention/step"][:].tolist() == [0]
        for name, (source, heads, off, i) in sites.items():
            assert source == "MultiheadAttention"
            module = net.get_submodule(name)
            args, kwargs = seen[name]
            q, k = (args + (kwargs.get("query"), kwargs.get("key")))[:2]
            probs, allowed = mha_probs(module, q, k, key_padding_mask=kwargs.get("key_padding_mask"),
                                       attn_mask=kwargs.get("attn_mask"),
                                       need_weights=kwargs.get("need_weights", True), return_allowed=True)
            want = head_stats(probs, allowed).numpy()
            got = np.stack([f[f"attention/{c}"][0, off:off + heads] for c in ("entropy", "max_weight", "sink_share")], 1)
            assert heads == want.shape[0]
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=name)
            np.testing.assert_allclose(f["attention/head_similarity"][0, i], head_similarity(probs).item(),
                                       rtol=2e-5, err_msg=name)
            assert f["attention/keys"][0, i] == 10
