"""Attention written out by hand: Hugging Face's eager attention (matmul, causal mask added as
the dtype's lowest value, nn.functional.softmax, matmul) is seen through F.softmax, named after
the module that calls it, and its entropy is judged over the keys the mask allows (issue 22).
A real GPT-2 from a config, trained a few steps on CPU."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from torchautopsy import Recorder, load
from torchautopsy.analyzer.run import analyze

transformers = pytest.importorskip("transformers")


def _train(qk_scale: float = 1.0):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for block in model.transformer.h:  # c_attn's columns: query, key, value
            block.attn.c_attn.weight[:, :64] *= qk_scale
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    run = tempfile.mkdtemp(prefix="eager_attn_")
    g = torch.Generator().manual_seed(0)
    losses = []
    with Recorder(model, run) as rec:
        for _ in range(25):
            ids = torch.randint(0, 64, (8, 16), generator=g)
            out = model(input_ids=ids, labels=ids)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            rec.step(loss=out.loss)
            losses.append(float(out.loss.detach()))
    return run, losses


def test_eager_attention_is_seen_and_a_causal_mask_is_not_taken_for_sharpness():
    run, _ = _train()
    rt = load(run).ranks[0]
    sites = rt.attention_sites
    assert list(sites["module"]) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert set(sites["source"]) == {"softmax"} and list(sites["heads"]) == [2, 2]
    entropy = rt.attention_stat("entropy").to_numpy()
    # Uniform over the keys each causal row may see, at initialisation: ~1 (with the masked keys
    # counted it would be far lower: row i sees i + 1 of 16).
    assert entropy[0].min() > 0.95
    assert not [f for f in analyze(load(run)) if f.severity in ("warning", "error")]


def test_eager_attention_one_hot_from_initialisation_is_a_collapse_at_step_0():
    run, _ = _train(qk_scale=60.0)
    entropy = load(run).ranks[0].attention_stat("entropy").to_numpy()
    assert np.nanmax(entropy[0]) < 0.1
    found = [f for f in analyze(load(run)) if f.kind == "attention_collapse"]
    assert found and found[0].step == 0 and found[0].where[0].startswith("transformer.h.")
