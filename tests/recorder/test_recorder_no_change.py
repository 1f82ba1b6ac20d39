"""The recorder never changes the training: same seed on CPU gives bit-identical losses and
final state (parameters and buffers) with and without it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from torchautopsy import Recorder

from recorder_testlib import batch, build, train_step
from tests.training import train

N_STEPS = 20


def _run(kind, run_dir=None, **options):
    model, opt = build(kind, seed=123)
    losses = []
    train(model, run_dir, N_STEPS, lambda step: batch(kind, step), F.cross_entropy, optimizer=opt,
          after_step=lambda step, loss: losses.append(loss.detach().clone()), **options)
    return torch.stack(losses), model.state_dict()


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_losses_and_weights_bit_identical(kind, tmp_path):
    base_losses, base_state = _run(kind)
    # Sample everything on every step: the heaviest recording must still change nothing.
    rec_losses, rec_state = _run(kind, tmp_path / "run", activations_every=1, update_ratio_every=1,
                                 histogram_every=1, sample_every=1, snapshot_every=1)
    assert torch.equal(rec_losses, base_losses), (rec_losses - base_losses).abs().max()
    assert base_state.keys() == rec_state.keys()
    for k in base_state:
        assert torch.equal(rec_state[k], base_state[k]), k
    # and the default schedule too
    def_losses, _ = _run(kind, tmp_path / "run2")
    assert torch.equal(def_losses, base_losses)
    # the recorded run really recorded
    assert (tmp_path / "run" / "rank0.h5").stat().st_size > 0


def test_recorder_keeps_no_activation_alive(tmp_path):
    """Hooks observe and keep no graph or activation tensor alive after the step."""
    model, opt = build("mlp")
    refs = []
    model[2].register_forward_hook(lambda m, a, out: refs.append(weakref.ref(out)))
    with Recorder(model, tmp_path / "run", activations_every=1) as rec:
        for step in range(3):
            x, y = batch("mlp", step)
            loss = train_step(model, opt, x, y)
            rec.step(loss=loss)
            del loss, x, y
            gc.collect()
            assert all(r() is None for r in refs), "an activation outlived its step"


def test_blackbox_firing_changes_nothing(tmp_path):
    """A NaN at step 5 fires the black box inside optimizer.step(): the run goes on exactly as
    without the recorder (NaN losses compare equal as NaN), and its final state is identical."""

    def run(run_dir):
        model, opt = build("cnn", seed=7)
        rec = Recorder(model, run_dir) if run_dir is not None else None
        losses = []
        for step in range(8):
            x, y = batch("cnn", step)
            if step == 5:
                x = x.clone()
                x[0, 0, 0, 0] = float("nan")
            loss = train_step(model, opt, x, y)
            if rec is not None:
                rec.step(loss=loss)
            losses.append(loss.detach().clone())
        if rec is not None:
            rec.close()
            assert not rec.captures.armed
        return torch.stack(losses), model.state_dict()

    base_losses, base_state = run(None)
    rec_losses, rec_state = run(tmp_path / "run")
    assert torch.equal(torch.isnan(rec_losses), torch.isnan(base_losses))
    assert torch.equal(torch.nan_to_num(rec_losses), torch.nan_to_num(base_losses))
    for k in base_state:
        assert torch.equal(torch.nan_to_num(rec_state[k]), torch.nan_to_num(base_state[k])), k
