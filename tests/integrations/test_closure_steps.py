"""Issue 21: the recorder's side of the integrations, in plain loops. An optimizer stepped with a
closure runs forward and backward inside optimizer.step(), after the global optimizer hook:
the hook skips it, and Recorder.before_optimizer_step(), called after the backward, judges
the gradients instead (Lightning's callback calls it from on_before_optimizer_step). Gradients
judged already this step are not judged again unless they changed since."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from torchautopsy import Recorder, load

from .common import BAD_STEP, N_STEPS, Body, assert_nan_found, assert_plain_loop_blackbox, batch, run_dir


def test_a_closure_step_is_judged_where_the_loop_says(tmp_path):
    run = run_dir()
    torch.manual_seed(0)
    model = Body()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kept = {}
    with Recorder(model, run) as rec:
        for step in range(N_STEPS):
            x, y = batch(step)
            if step == BAD_STEP:
                kept.update(state=copy.deepcopy(model.state_dict()), inputs=[x],
                            exp_avg=opt.state[model.fc1.weight]["exp_avg"].clone())

            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                rec.before_optimizer_step(opt)  # after backward, before the update
                return loss

            loss = opt.step(closure)
            rec.step(loss=loss)
    assert load(run).ranks[0].step_index.tolist() == list(range(N_STEPS))
    assert_nan_found(run)
    assert_plain_loop_blackbox(run, kept, ["forward0.args.0"])


def test_gradients_are_judged_once_unless_they_change():
    """before_optimizer_step() then optimizer.step(): judged once (one set of norms). Clipping in
    between writes the gradients in place: judged again, and the row has the clipped norms."""
    run = run_dir()
    torch.manual_seed(0)
    model = Body()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    judged, clipped = [], []
    with Recorder(model, run) as rec:
        for step in range(6):
            x, y = batch(step, bad=None)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            rec.before_optimizer_step(opt)
            rec.before_optimizer_step(opt)  # nothing changed: nothing to do
            if step % 2:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            judged.append(len(rec.norms.entries))
            clipped.append([float(p.grad.norm()) for p in model.parameters()])
            rec.step(loss=0.0)
    assert judged == [1, 2] * 3
    grad_norm = load(run).ranks[0].param_stat("grad_norm").to_numpy()
    np.testing.assert_allclose(grad_norm, np.array(clipped), rtol=1e-5)
