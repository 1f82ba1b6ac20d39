"""Issue 37 (2): the innermost origin of a NaN/-Inf.

- A weightless submodule (``encoder.logpower``: the log of an all-zero frame) makes -Inf, its
  parent's forward puts it into a torch.cat and normalises it (NaN): named was the parent
  (``encoder``); the origin is the submodule, the parent the one that made NaN of it.
- The same kind of -Inf in a front-end before a GRU, whose saturated gates keep the forward and
  the loss finite while the backward goes NaN: named was ``rnn.weight_ih_l0``; the origin is the
  front-end.
Both on a watched step (10) and on one the black box replays (13), in a plain loop and under
Lightning (whose replay runs training_step)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder
from tests.helpers import invoke_cli


class LogPower(nn.Module):
    def forward(self, x):  # the log-energy of each frame: -Inf for an all-zero frame
        return torch.log(x.pow(2).mean(-1, keepdim=True))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.logpower, self.proj = LogPower(), nn.Linear(17, 32)

    def forward(self, x):
        h = torch.cat([x, self.logpower(x)], -1)
        h = (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-5)  # -inf - -inf: NaN
        return self.proj(h)


class EncoderNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.head = Encoder(), nn.Linear(32, 3)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


class Front(nn.Module):
    def forward(self, x):  # (B, T, 16) frames -> their features and log-energy, (B, T, 17)
        return torch.cat([x, torch.log(x.pow(2).mean(-1, keepdim=True))], -1)


class GruNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.front, self.rnn, self.head = Front(), nn.GRU(17, 32, batch_first=True), nn.Linear(32, 3)

    def forward(self, x):
        out, _ = self.rnn(self.front(x))
        return self.head(out[:, -1])


CASES = {"encoder": (EncoderNet, (8, 16), "encoder.logpower"), "gru": (GruNet, (8, 5, 16), "front")}


def _batch(g, shape, step: int, bad: int):
    x, y = torch.randn(*shape, generator=g), torch.randint(0, 3, (shape[0],), generator=g)
    if step == bad:
        x[(3,) if len(shape) == 2 else (3, 2)] = 0  # one all-zero frame
    return x, y


def _findings(run: Path) -> list[dict]:
    out = run.parent / "f.json"
    assert invoke_cli("analyze", run, "--json", out, block_torch=True).returncode == 0
    return [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "nonfinite"]


@pytest.mark.parametrize("bad", [10, 13], ids=["watched", "replayed"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_innermost_module_that_made_the_minus_inf_is_named(case, bad):
    make, shape, origin = CASES[case]
    torch.manual_seed(0)
    net = make()
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    g = torch.Generator().manual_seed(0)
    run = Path(tempfile.mkdtemp(prefix="inner_")) / "run"
    with Recorder(net, run) as rec:
        for step in range(16):
            x, y = _batch(g, shape, step, bad)
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    (f,) = _findings(run)
    assert (f["step"], f["where"], f["evidence"]["stage"]) == (bad, [origin], "forward"), f
    if case == "gru":  # the loss stayed finite: the backward made the NaN
        assert "the layers after it kept the forward and the loss finite" in f["summary"]


@pytest.mark.slow  # Lightning
def test_under_lightning_the_replayed_step_names_the_submodule():
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from torchautopsy.lightning import TorchAutopsyCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = EncoderNet()

        def training_step(self, b, i):
            x, y = b
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-3)

    g = torch.Generator().manual_seed(0)
    xs, ys = zip(*(_batch(g, (8, 16), step, 13) for step in range(16)))
    run = Path(tempfile.mkdtemp(prefix="inner_pl_")) / "run"
    torch.manual_seed(0)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=run.parent,
                         callbacks=[TorchAutopsyCallback(run)])
    trainer.fit(Module(), DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8))
    (f,) = _findings(run)
    assert (f["step"], f["where"]) == (13, ["net.encoder.logpower"]), f
