"""Issue 36: a GPT with nanoGPT's interface (tests/models/nanogpt.py) under torch.compile, the
Recorder given the compiled module or the eager one compiled after it.

Its forward returns ``(logits, None)`` without targets (the recorder stopped at step 0 on the
None and the analyzer called the empty trace clean) and ``(logits, loss)`` with them. Each run
here records every step, trains exactly as the same compiled model without the recorder, adds
no compilation (Dynamo's own counters), and a NaN from the batch (every target ignore_index:
cross_entropy's mean over 0 targets) on a step that was not watched is named with its module
and step, from the black box's inputs replayed on an eager copy.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from torchautopsy import Recorder, load
from tests.helpers import invoke_cli
from tests.models.nanogpt import GPT, GPTConfig

STEPS = 24
BAD = 13  # not a watched step (0, 10, 20, ...)
ORDERS = ["recorder_on_compiled", "compile_after_recorder"]


def _batch(step: int, bad: bool):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, 64, (8, 16), generator=g)
    y = torch.roll(x, -1, 1)
    if bad and step == BAD:
        y[:] = -1  # every target ignored
    return x, y


def train(order: str, record: bool = True, targets_inside: bool = True, bad: bool = False):
    """(losses, graphs Dynamo made, run dir, warnings) of STEPS steps of a compiled nanoGPT."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = Path(tempfile.mkdtemp(prefix="nanogpt_")) / "run"
    rec = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order == "recorder_on_compiled":
            fwd = torch.compile(model, backend="aot_eager")
            rec = Recorder(fwd, run) if record else None
        else:
            rec = Recorder(model, run) if record else None
            fwd = torch.compile(model, backend="aot_eager")
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, bad)
            if targets_inside:
                _, loss = fwd(x, y)
            else:  # (logits, None): the loss computed outside
                logits, _ = fwd(x)
                loss = F.cross_entropy(logits.reshape(-1, 64), y[:, -1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rec is not None:
                rec.step(loss=loss)
            losses.append(loss.detach().clone())
        if rec is not None:
            rec.close()
    ours = [str(w.message) for w in caught if "torchautopsy" in str(w.message)]
    return torch.stack(losses), counters["stats"]["unique_graphs"], run, ours


_bare: dict = {}


def bare(targets_inside: bool = True, bad: bool = False):
    """The run without the recorder, made once for both orders: without a Recorder they are the
    same run (torch.compile of the same fresh model, nothing else created)."""
    key = (targets_inside, bad)
    if key not in _bare:
        _bare[key] = train(ORDERS[0], record=False, targets_inside=targets_inside, bad=bad)
    return _bare[key]


def findings(run: Path) -> list[dict]:
    """The CLI's findings, in this process (the CLI as a process is tested elsewhere: here a
    fresh interpreter cost more than the analysis)."""
    out = run.parent / "f.json"
    r = invoke_cli("analyze", run, "--json", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["findings"]


@pytest.mark.parametrize("targets_inside", [False, True], ids=["logits_none", "logits_loss"])
@pytest.mark.parametrize("order", ORDERS)
def test_a_healthy_compiled_nanogpt_is_recorded_whole_clean_and_compiled_once(order, targets_inside):
    base, base_graphs, _, _ = bare(targets_inside=targets_inside)
    losses, graphs, run, ours = train(order, targets_inside=targets_inside)
    assert ours == []
    assert torch.equal(losses, base)  # trains as without the recorder
    assert graphs == base_graphs  # no recompile added (hooks coming and going, the black box's state)
    rt = load(run).ranks[0]
    assert rt.closed_cleanly and rt.n_steps == STEPS
    assert rt.module_names[:3] == ["", "transformer", "transformer.wte"]  # the model's names, no _orig_mod
    # The root's hooks run eagerly: the forward is timed; token ids give no float batch statistics.
    assert np.isfinite(rt.steps["forward_s"].to_numpy()).all()
    assert np.isnan(rt.steps["input_mean"].to_numpy()).all()
    bad = [f for f in findings(run) if f["severity"] in ("error", "warning")]
    assert bad == [], bad


@pytest.mark.parametrize("order", ORDERS)
def test_a_nan_from_the_batch_is_named_in_both_orders(order):
    base, base_graphs, _, _ = bare(bad=True)
    losses, graphs, run, _ = train(order, bad=True)
    assert torch.allclose(losses, base, rtol=0, atol=0, equal_nan=True)  # bit for bit, the NaN too
    assert not torch.isfinite(losses[BAD]) and graphs == base_graphs
    (f,) = [f for f in findings(run) if f["kind"] == "nonfinite"]
    # Born in the model's own forward (its cross_entropy over no target), found by the replay.
    assert (f["step"], f["where"]) == (BAD, [""]), f
    assert "GPT" in f["summary"]
    rt = load(run).ranks[0]
    box = rt.blackbox.iloc[0]
    assert int(box["step"]) == BAD and box["detail"]["forward_calls"] == 1
    assert box["detail"]["trigger_detail"].get("origin_replay", "").startswith("reproduced"), box["detail"]
    names = set(rt.tensors_of("blackbox", BAD)["name"])
    assert {"forward0.args.0", "forward0.args.1"} <= names
