"""Issue 21: the Hugging Face TrainerCallback, with the real transformers Trainer.

The Trainer clears the gradients before on_step_end and gives callbacks no loss: these runs check
that the callback still records one row per optimizer step (also with gradient accumulation),
the loss the Trainer logged, steps from 0, a NaN found at its step and module, and the black box
of a plain loop (inputs, NaN gradients, optimizer state, parameters before the update)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

transformers = pytest.importorskip("transformers")
# Trainer and TrainingArguments as transformers.X where used: importing them costs ~4.5 CPU-s,
# which every xdist worker paid at collection, not only the one that runs these tests.
from transformers import TrainerCallback  # noqa: E402

from torchautopsy import load  # noqa: E402
from torchautopsy.huggingface import TorchAutopsyCallback  # noqa: E402

from .common import BAD_STEP, N_STEPS, Body, assert_nan_found, assert_plain_loop_blackbox, batch, run_dir  # noqa: E402


class Net(nn.Module):
    """A plain torch model as the Trainer takes one: keyword inputs, a dict with the loss out.
    Its forward takes no **kwargs: the Trainer gives it no num_items_in_batch."""

    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, x, labels=None):
        logits = self.body(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Batches(IterableDataset):
    """The examples of batch(0), batch(1), ... in order (no sampler: batch i is step i's)."""

    def __init__(self, n_batches: int, bad: int | None):
        self.n_batches, self.bad = n_batches, bad

    def __iter__(self):
        for i in range(self.n_batches):
            x, y = batch(i, self.bad)
            for j in range(len(x)):
                yield {"x": x[j], "labels": y[j]}


class Tokens(IterableDataset):
    """Random token sequences for a causal LM (labels = input_ids: the model shifts them)."""

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        while True:
            ids = torch.randint(0, 64, (12,), generator=g)
            yield {"input_ids": ids, "labels": ids.clone()}


def _tiny_gpt2():
    """A randomly initialised 2-layer GPT-2 (nothing downloaded). Its forward takes **kwargs:
    the Trainer gives it num_items_in_batch and does not divide its loss by the accumulation."""
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def _train(model, dataset, callbacks, out, max_steps: int, **args) -> "transformers.Trainer":
    resume = args.pop("resume_from_checkpoint", None)
    targs = transformers.TrainingArguments(**{**dict(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=16, learning_rate=1e-2,
        lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.0, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0), **args})
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _logged_losses(trainer: "transformers.Trainer") -> np.ndarray:
    return np.array([h["loss"] for h in trainer.state.log_history if "loss" in h])


def test_a_nan_run_is_recorded_as_in_a_plain_loop():
    run = run_dir()
    kept = {}

    class Keeper(TrainerCallback):
        """What the bad step starts from, to compare the black box with."""

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step == BAD_STEP:
                kept["state"] = copy.deepcopy(model.state_dict())
                kept["exp_avg"] = optimizer.state[model.body.fc1.weight]["exp_avg"].clone()

    torch.manual_seed(0)
    trainer = _train(Net(), Batches(N_STEPS, BAD_STEP), [TorchAutopsyCallback(run), Keeper()], run.parent, N_STEPS)
    rt = load(run).ranks[0]
    assert rt.closed_cleanly
    assert rt.step_index.tolist() == list(range(N_STEPS))  # one row per optimizer step, from 0
    loss = rt.steps["loss"].to_numpy()
    # The Trainer's log replaces a NaN loss (logging_nan_inf_filter); the trace keeps it.
    assert np.isfinite(loss[:BAD_STEP]).all() and not np.isfinite(loss[BAD_STEP])
    np.testing.assert_allclose(loss[:BAD_STEP], _logged_losses(trainer)[:BAD_STEP], rtol=1e-6)
    # The gradients of every step (the Trainer clears them before on_step_end), NaN at the bad one.
    assert np.isfinite(rt.param_stat("grad_norm").iloc[:BAD_STEP].to_numpy()).all()
    assert rt.param_stat("grad_nonfinite").loc[BAD_STEP, "body.fc1.weight"] > 0
    assert_nan_found(run, where="body.expo")
    x, y = batch(BAD_STEP)
    kept["inputs"] = [x, y]
    assert_plain_loop_blackbox(run, kept, ["forward0.kwargs.x", "forward0.kwargs.labels"], prefix="body.",
                               optimizer="AdamW")


@pytest.mark.parametrize("kind", ["plain", "gpt2"])
def test_gradient_accumulation_gives_one_row_per_optimizer_step(kind):
    """gradient_accumulation_steps=2: 6 optimizer steps of 2 micro-batches, 6 rows, each with the
    loss the Trainer logged for the step: the mean of the micro-batches' losses (plain), or the
    sum of the losses the model normalised over the whole step itself (GPT-2, num_items_in_batch)."""
    run = run_dir()
    torch.manual_seed(0)
    model, data = (Net(), Batches(12, None)) if kind == "plain" else (_tiny_gpt2(), Tokens())
    trainer = _train(model, data, [TorchAutopsyCallback(run)], run.parent, 6, gradient_accumulation_steps=2)
    rt = load(run).ranks[0]
    assert rt.step_index.tolist() == list(range(6))
    logged = _logged_losses(trainer)
    assert len(logged) == 6
    np.testing.assert_allclose(rt.steps["loss"].to_numpy(), logged, rtol=1e-6)
    assert np.isfinite(rt.param_stat("grad_norm").to_numpy()).all()


def test_a_run_resumed_from_a_checkpoint_keeps_both_attempts_on_one_step_axis():
    """train(resume_from_checkpoint=) into the same run directory: the first attempt's trace is
    kept, the second writes rank0.attempt2.h5 numbered from the checkpoint's step, and load()
    reads them as one timeline."""
    run = run_dir()
    torch.manual_seed(0)
    _train(Net(), Batches(6, None), [TorchAutopsyCallback(run)], run.parent, 6, save_strategy="steps", save_steps=3)
    torch.manual_seed(0)
    _train(Net(), Batches(6, None), [TorchAutopsyCallback(run)], run.parent, 6,
           resume_from_checkpoint=str(run.parent / "checkpoint-3"))
    assert load(run / "rank0.h5").ranks[0].step_index.tolist() == list(range(6))
    assert load(run / "rank0.attempt2.h5").ranks[0].step_index.tolist() == [3, 4, 5]
    trace = load(run)
    assert [a.file for a in trace.attempts[0]] == ["rank0.h5", "rank0.attempt2.h5"]
    assert trace.ranks[0].step_index.tolist() == list(range(6))
