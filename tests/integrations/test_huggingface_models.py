"""Issue 36: transformers' own GPT-2 and BERT under the real Trainer, with the project's callback.

A healthy run must be clean: the Trainer passes ``num_items_in_batch`` to the model as a 0-d
float tensor, which the recorder once took for the batch (every report opened with "the inputs
were never normalised ... 100 batches were constant"); GPT-2's NewGELUActivation computes GELU
with a tanh, once reported as a saturated tanh layer. And a NaN that a user's forward hook writes
on a step that was not watched is named with its module and step: the replay runs the user's
hooks on the Trainer's inputs, as the step did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

transformers = pytest.importorskip("transformers")
# Trainer and TrainingArguments as transformers.X where used: importing them costs ~4.5 CPU-s,
# which every xdist worker paid at collection, not only the one that runs these tests.
from transformers import TrainerCallback  # noqa: E402

from torchautopsy import load  # noqa: E402
from torchautopsy.huggingface import TorchAutopsyCallback  # noqa: E402

from .common import analyze, run_dir  # noqa: E402

BAD = 27  # not a watched step


class Sequences(IterableDataset):
    """Token sequences with padding (id 0) at their ends: causal LM examples (GPT-2) or a
    two-class labelling of the first token's parity (BERT)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        while True:
            ids = torch.randint(1, 64, (12,), generator=g)
            ids[-3:] = 0
            if self.kind == "gpt2":
                yield {"input_ids": ids, "labels": ids.clone()}
            else:
                yield {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor(int(ids[0] % 2))}


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":  # (activation_function: gelu_new, the tanh approximation, by default)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16))


def _train(kind: str, steps: int, poison: bool = False):
    run = run_dir()
    model = _model(kind)
    callbacks = [TorchAutopsyCallback(run)]
    if poison:
        at = {"step": -1}

        class Step(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                at["step"] = state.global_step

        callbacks.append(Step())
        target = model.transformer.h[1].mlp if kind == "gpt2" else model.bert.encoder.layer[1].intermediate
        target.register_forward_hook(lambda m, a, out: out * float("nan") if at["step"] == BAD else None)
    args = transformers.TrainingArguments(
        output_dir=str(run.parent), max_steps=steps, per_device_train_batch_size=16, learning_rate=1e-3,
        optim="adamw_torch", max_grad_norm=1.0, logging_steps=10, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    transformers.Trainer(model=model, args=args, train_dataset=Sequences(kind), callbacks=callbacks).train()
    return run


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_healthy_trainer_run_is_clean(kind):
    run = _train(kind, 100)
    problems = [f for f in analyze(run) if f["severity"] in ("error", "warning")]
    assert problems == [], problems
    rt = load(run).ranks[0]
    # The batch is the token ids (no float statistics), never the scalar num_items_in_batch.
    assert np.isnan(rt.steps["input_mean"].to_numpy()).all()
    # GPT-2's GELU (NewGELUActivation) is not a tanh layer; BERT's pooler (an nn.Tanh) is one.
    tanh = rt.activity_sites[rt.activity_sites["function"] == "tanh"]
    assert list(tanh["module"]) == ([] if kind == "gpt2" else ["bert.pooler.activation"])


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_nan_a_user_hook_writes_on_an_unwatched_step_is_named(kind):
    run = _train(kind, 40, poison=True)
    (f,) = [f for f in analyze(run) if f["kind"] == "nonfinite"]
    where = "transformer.h.1.mlp" if kind == "gpt2" else "bert.encoder.layer.1.intermediate"
    assert (f["step"], f["where"]) == (BAD, [where]), f
    assert "ignore_index" not in f["summary"]
