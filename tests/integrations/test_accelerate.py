"""Issue 21: Accelerate has no callbacks; the recipe of docs/recording.md (a Recorder in the user's own loop)
is run here as written, with the real Accelerator on CPU and gradient accumulation: one row per
optimizer step with the mean loss of its micro-batches, a NaN found at its step and module, and
the black box of a plain loop (accelerate's optimizer wrapper steps the torch optimizer, whose
step the recorder's global hook judges)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

from torchautopsy import Recorder, load  # noqa: E402

from .common import BAD_STEP, N_STEPS, Body, assert_nan_found, assert_plain_loop_blackbox, batch, run_dir  # noqa: E402

ACCUMULATE = 2
BAD_BATCH = ACCUMULATE * BAD_STEP  # the first micro-batch of step BAD_STEP


def test_the_readme_recipe_records_one_row_per_optimizer_step():
    run = run_dir()
    torch.manual_seed(0)
    model = Body()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    xs, ys = zip(*(batch(i, BAD_BATCH) for i in range(ACCUMULATE * N_STEPS)))
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=16, shuffle=False)
    computed, kept, calls = [], {}, []  # what the loop computed, and what the bad step started from

    def keep(module, args):
        calls.append(1)
        if len(calls) == BAD_BATCH + 1:  # the forward of the bad micro-batch, before it runs
            kept["state"] = copy.deepcopy(model.state_dict())
            kept["exp_avg"] = optimizer.state[model.fc1.weight]["exp_avg"].clone()

    model.register_forward_pre_hook(keep)

    def loss_fn(out, y):
        loss = F.cross_entropy(out, y)
        computed.append(loss.detach().clone())
        return loss

    # -- docs/recording.md's recipe, as written there -------------------------------------------------
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with Recorder(accelerator.unwrap_model(model), run) as rec:    # one rank{N}.h5 per process
        losses = []
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(x), y)
                accelerator.backward(loss)
                optimizer.step()                   # steps only at the end of an accumulation
                losses.append(loss.detach())
                if accelerator.sync_gradients:     # an optimizer step: one row, before zero_grad()
                    rec.step(loss=torch.stack(losses).mean())
                    losses.clear()
                optimizer.zero_grad()
    # ------------------------------------------------------------------------------------------

    rt = load(run).ranks[0]
    assert rt.closed_cleanly
    assert rt.step_index.tolist() == list(range(N_STEPS))
    expected = torch.stack(computed).reshape(N_STEPS, ACCUMULATE).mean(dim=1).numpy()
    loss = rt.steps["loss"].to_numpy()
    assert np.isfinite(loss[:BAD_STEP]).all() and not np.isfinite(loss[BAD_STEP])
    np.testing.assert_allclose(loss[:BAD_STEP], expected[:BAD_STEP], rtol=1e-6)
    assert np.isfinite(rt.param_stat("grad_norm").iloc[:BAD_STEP].to_numpy()).all()
    assert_nan_found(run)
    kept["inputs"] = [xs[BAD_BATCH], xs[BAD_BATCH + 1]]  # both micro-batches of the step
    assert_plain_loop_blackbox(run, kept, ["forward0.args.0", "forward1.args.0"])
