"""Issue 36: the replay of a bad step runs what the step ran, the user's forward hooks included,
and when it cannot reproduce the NaN/Inf the finding says why, with no hint the evidence does
not support (it once blamed "every target is ignore_index" for a NaN a hook wrote)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder
from tests.helpers import invoke_cli

BAD = 7  # not a watched step


def _run(hook) -> Path:
    run = Path(tempfile.mkdtemp(prefix="hooks_")) / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
    state = {"step": 0}
    model[2].register_forward_hook(lambda m, args, out: hook(state, out))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(1)
    with Recorder(model, run) as rec:
        for step in range(12):
            state["step"] = step
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    return run


def _nonfinite(run: Path) -> dict:
    out = run.parent / "f.json"
    assert invoke_cli("analyze", run, "--json", out, block_torch=True).returncode == 0
    (f,) = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "nonfinite"]
    return f


def test_a_nan_a_user_hook_writes_is_named_at_the_hooked_module():
    f = _nonfinite(_run(lambda state, out: out * float("nan") if state["step"] == BAD else None))
    assert (f["step"], f["where"]) == (BAD, ["2"]), f


def test_a_nan_the_replay_cannot_reproduce_says_why_and_blames_no_loss_op():
    def once(state, out):  # the hook's own state moves on: a replay of the step sees it finite
        if state["step"] == BAD:
            state["step"] = -1
            return out * float("nan")
        return None

    f = _nonfinite(_run(once))
    assert (f["step"], f["where"], f["evidence"]["stage"]) == (BAD, [], "unchecked"), f
    assert "not reproduced: every module output of the replayed forward was finite" in f["summary"]
    assert "a counter a hook or the forward reads" in f["summary"]
    assert "ignore_index" not in f["summary"] and "loss function uses" not in f["summary"]
