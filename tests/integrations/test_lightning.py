"""Issue 21: the Lightning callbacks, with the real `lightning` and `pytorch_lightning` Trainers.

Lightning steps the optimizer with a closure that runs training_step and backward inside
optimizer.step(): the recorder's global optimizer hook runs before them. These runs check that
the callback still gives one row per optimizer step, with Lightning's loss, steps from 0, a NaN
found at its step and module, and the black box of a plain loop (inputs, NaN gradients,
optimizer state, parameters before the update)."""

from __future__ import annotations

import copy
import importlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchautopsy import load

from .common import BAD_STEP, N_STEPS, Body, assert_nan_found, assert_plain_loop_blackbox, batch, blackbox, run_dir

FRAMEWORKS = ["lightning", "pytorch_lightning"]


def _framework(name: str):
    """(the Trainer's package, the callback for it)."""
    pl = pytest.importorskip("lightning.pytorch" if name == "lightning" else "pytorch_lightning")
    return pl, importlib.import_module(f"torchautopsy.{name}").TorchAutopsyCallback


def _module_class(pl):
    class Net(pl.LightningModule):
        """Body's layers on the LightningModule itself; training_step calls self(x), as usual."""

        def __init__(self):
            super().__init__()
            body = Body()
            self.fc1, self.expo, self.bn, self.fc2, self.head = body.fc1, body.expo, body.bn, body.fc2, body.head
            self.losses: list[torch.Tensor] = []  # training_step's loss, batch by batch

        def forward(self, x):
            return self.head(self.fc2(torch.relu(self.bn(self.expo(self.fc1(x))))))

        def training_step(self, b, batch_idx):
            x, y = b
            loss = F.cross_entropy(self(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return Net


def _loader(n_batches: int, bad: int | None) -> DataLoader:
    xs, ys = zip(*(batch(i, bad) for i in range(n_batches)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=16, shuffle=False)


def _fit(pl, callbacks, n_batches: int, bad: int | None, tmp, **trainer_args):
    torch.manual_seed(0)
    model = _module_class(pl)()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                         callbacks=callbacks, **trainer_args)
    trainer.fit(model, _loader(n_batches, bad))
    return model


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_nan_run_is_recorded_as_in_a_plain_loop(name):
    pl, Callback = _framework(name)
    run = run_dir()
    kept = {}

    class Keeper(pl.Callback):
        """What the bad step starts from, to compare the black box with."""

        def on_train_batch_start(self, trainer, module, b, batch_idx):
            if batch_idx == BAD_STEP:
                kept["state"] = copy.deepcopy(module.state_dict())
                kept["exp_avg"] = trainer.optimizers[0].state[module.fc1.weight]["exp_avg"].clone()
                kept["inputs"] = [b[0].clone()]

    model = _fit(pl, [Callback(run), Keeper()], N_STEPS, BAD_STEP, run.parent)
    rt = load(run).ranks[0]
    assert rt.closed_cleanly
    assert rt.step_index.tolist() == list(range(N_STEPS))  # one row per optimizer step, from 0
    loss = rt.steps["loss"].to_numpy()
    expected = torch.stack(model.losses).numpy()
    assert np.array_equal(np.isfinite(loss), np.isfinite(expected)) and not np.isfinite(loss[BAD_STEP])
    assert np.array_equal(loss[:BAD_STEP], expected[:BAD_STEP])  # float32 both: exact
    # The gradients of every step are recorded (finite before the bad step), and the NaN ones at it.
    grad_norm = rt.param_stat("grad_norm")
    assert np.isfinite(grad_norm.iloc[:BAD_STEP].to_numpy()).all()
    assert rt.param_stat("grad_nonfinite").loc[BAD_STEP, "fc1.weight"] > 0
    assert_nan_found(run)
    assert_plain_loop_blackbox(run, kept, ["forward0.args.0"])


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_gradient_accumulation_gives_one_row_per_optimizer_step(name):
    """accumulate_grad_batches=2: 12 batches, 6 optimizer steps, 6 rows, each with the mean loss
    of its two batches (what Lightning backpropagated), and its gradient norms."""
    pl, Callback = _framework(name)
    run = run_dir()
    model = _fit(pl, [Callback(run)], 12, None, run.parent, accumulate_grad_batches=2)
    rt = load(run).ranks[0]
    assert rt.step_index.tolist() == list(range(6))
    per_batch = torch.stack(model.losses)
    expected = (per_batch.reshape(6, 2) / 2).sum(dim=1).numpy()
    np.testing.assert_allclose(rt.steps["loss"].to_numpy(), expected, rtol=1e-6)
    assert np.isfinite(rt.param_stat("grad_norm").to_numpy()).all()


def test_a_grad_scaler_s_skipped_overflows_do_not_fire_the_black_box():
    """precision="16-mixed" with a GradScaler (on CPU here): the scaler calls optimizer.step()
    without a closure, and only for finite gradients. The first steps overflow at a huge initial
    scale and are skipped, as AMP does: no reason to fire. The NaN born at BAD_STEP still is."""
    pl, Callback = _framework("lightning")
    from lightning.pytorch.plugins import MixedPrecision

    run = run_dir()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    scales = []

    class Scales(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, b, batch_idx):
            scales.append(scaler.get_scale())

    model = _fit(pl, [Callback(run), Scales()], N_STEPS, BAD_STEP, run.parent,
                 plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert scales[0] < 2.0**24  # the first step overflowed and was skipped
    rt = load(run).ranks[0]
    assert rt.step_index.tolist() == list(range(N_STEPS))
    loss = rt.steps["loss"].to_numpy()
    expected = torch.stack(model.losses).numpy()
    assert np.array_equal(loss[:BAD_STEP], expected[:BAD_STEP]) and not np.isfinite(loss[BAD_STEP])
    assert rt.blackbox["step"].tolist() == [BAD_STEP]
    assert_nan_found(run)


def test_a_fit_resumed_from_a_checkpoint_keeps_both_attempts_on_one_step_axis():
    """fit(ckpt_path=) into the same run directory: the first attempt's trace is kept, the second
    writes rank0.attempt2.h5 numbered on from the checkpoint's global step."""
    pl, Callback = _framework("lightning")
    run = run_dir()
    torch.manual_seed(0)
    trainer_args = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=run.parent)
    model = _module_class(pl)()
    first = pl.Trainer(max_steps=3, callbacks=[Callback(run)], **trainer_args)
    first.fit(model, _loader(8, None))
    first.save_checkpoint(run.parent / "step3.ckpt")
    second = pl.Trainer(max_steps=6, callbacks=[Callback(run)], **trainer_args)
    second.fit(_module_class(pl)(), _loader(8, None), ckpt_path=run.parent / "step3.ckpt")
    assert load(run / "rank0.h5").ranks[0].step_index.tolist() == [0, 1, 2]
    assert load(run / "rank0.attempt2.h5").ranks[0].step_index.tolist() == [3, 4, 5]
    assert load(run).ranks[0].step_index.tolist() == list(range(6))


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_training_step_that_calls_a_child_is_replayed_and_its_nan_named(name):
    """training_step calls self.model(x), not self(x), and logs its loss (issue 36): the
    LightningModule's own forward never runs, so the black box keeps the batch and the replay runs
    training_step on it (on a copy without the Trainer: its self.log() is skipped)."""
    pl, Callback = _framework(name)

    class Wrapper(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Body()

        def training_step(self, b, batch_idx):
            x, y = b
            loss = F.cross_entropy(self.model(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    run = run_dir()
    torch.manual_seed(0)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=run.parent,
                         callbacks=[Callback(run)])
    trainer.fit(Wrapper(), _loader(N_STEPS, BAD_STEP))
    assert_nan_found(run, where="model.expo")
    rt = load(run).ranks[0]
    box = rt.blackbox.iloc[0]
    assert box["detail"]["step_calls"] == ["training_step"] and box["detail"]["forward_calls"] == 0
    assert box["detail"]["trigger_detail"]["origin_replay"] == "reproduced: module 'model.expo'"
    x, y = batch(BAD_STEP)  # the batch, exported as training_step's first argument
    _, _, tensors = blackbox(run)
    assert torch.equal(tensors["training_step0.args.0.0"], x) and torch.equal(tensors["training_step0.args.0.1"], y)
