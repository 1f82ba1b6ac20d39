"""What every case of make_samples.py shares: the recorded training loop (``_train``) and the
loss summary a case checks its run against (``_loss_summary``, ``_expect_learned``). The family
modules (cases_*.py) import these; none of them imports make_samples.py, the driver that imports
them all.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from sample_truth import read_trace

from torchautopsy import Recorder


def _train(model, run_dir, n_steps, batch_fn, loss_fn, opt, sched=None, clip=None, before_step=None,
           after_backward=None, backward_kwargs=None):
    """The usual loop, recorded: forward, loss, zero_grad, backward, (clip), step, rec.step(loss).
    batch_fn(step) -> inputs tuple and target; before_step(step) runs first (measurements)."""
    with Recorder(model, run_dir) as rec:
        for step in range(n_steps):
            if before_step is not None:
                before_step(step)
            inputs, target = batch_fn(step)
            loss = loss_fn(model(*inputs), target)
            opt.zero_grad()
            loss.backward(**(backward_kwargs or {}))
            if after_backward is not None:
                after_backward(step, loss)
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if sched is not None:
                sched.step()
            rec.step(loss=loss)  # no NaN check in these loops: they train on, like many real jobs


def _loss_summary(run_dir) -> dict:
    t = read_trace(run_dir)
    loss = t["loss"]
    n = max(5, len(loss) // 10)
    return {"loss_first_tenth_median": round(float(np.median(loss[:n])), 4),
            "loss_last_tenth_median": round(float(np.median(loss[-n:])), 4)}


def _expect_learned(case, run_dir, factor=0.5) -> dict:
    s = _loss_summary(run_dir)
    print(f"  loss median first tenth {s['loss_first_tenth_median']:.4g} -> last tenth "
          f"{s['loss_last_tenth_median']:.4g}")
    if not s["loss_last_tenth_median"] < factor * s["loss_first_tenth_median"]:
        raise SystemExit(f"{case}: the model did not learn ({s})")
    return s
