"""Real small models, deterministic data and a trace reader shared by the recorder tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import h5py
import torch
from torch import nn
import torch.nn.functional as F


# -- models -----------------------------------------------------------------------------------
class Exp(nn.Module):
    """exp() of its input: overflows to +Inf when an input element exceeds ~88."""

    def forward(self, x):
        return torch.exp(x)


class Net(nn.Module):
    """Linear -> Exp -> BatchNorm (buffers in its state_dict) -> ReLU -> Linear -> Linear. Finite
    for ordinary batches; a batch scaled by 1e3 makes Exp overflow, and BatchNorm turns Inf into NaN."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.expo = Exp()
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.bn(self.expo(self.fc1(x))))))


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(),
        nn.Linear(16, 16), nn.ReLU(),
        nn.Linear(16, 3),
    )


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(24, 3),
    )


class TinyTransformer(nn.Module):
    def __init__(self, d_in: int = 5, d_model: int = 16, n_classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(d_in, d_model)
        layer = nn.TransformerEncoderLayer(d_model=d_model, nhead=2, dim_feedforward=32,
                                           dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x):
        h = self.encoder(self.embed(x))
        return self.head(h.mean(dim=1))


def make_transformer() -> nn.Module:
    return TinyTransformer()


MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer}

# Modules whose sampled activation statistics the round-trip test checks against its own hooks
# (a Linear and, where the model has one as a module, a ReLU).
WATCHED = {
    "mlp": ["0", "1", "4"],
    "cnn": ["2", "9"],
    "transformer": ["embed", "encoder.layers.0.linear1", "head"],
}


def batch(kind: str, step: int, n: int = 16):
    """The (input, target) batch of a step: the same for every run, independent of model RNG."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        x = torch.randn(n, 8, generator=g)
    elif kind == "cnn":
        x = torch.randn(n, 1, 8, 8, generator=g)
    else:
        x = torch.randn(n, 6, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[kind]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def train_step(model, opt, x, y):
    out = model(x)
    loss = F.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


# -- traces -----------------------------------------------------------------------------------
@contextlib.contextmanager
def open_trace(path):
    """Open a trace for reading: plain first, SWMR if the writer never closed it (killed)."""
    try:
        f = h5py.File(path, "r")
    except OSError:
        f = h5py.File(path, "r", swmr=True)
    try:
        yield f
    finally:
        f.close()


def names(ds) -> list[str]:
    return list(ds.asstr()[:])


def attr_str(f, key) -> str:
    v = f.attrs[key]
    return v.decode() if isinstance(v, bytes) else str(v)


def hooks_left(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# -- a job pre-empted and restarted (test_restarts.py, tests/cli/test_restarts_cli.py) ----------
# Trains an MLP with Adam, checkpoints after step 29 (30 optimizer steps), plants a NaN in the
# batch of step 35 of the first attempt, and at step 41 flushes and waits to be killed. With
# --resume it loads the checkpoint and trains steps 30-59 cleanly; START (an int) is passed as
# start_step, "auto" lets the recorder read the step from Adam's state.
JOB = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from torchautopsy import Recorder

    torch.set_num_threads(1)
    run_dir, ckpt, mode, start = sys.argv[1:5]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = (torch.optim.Adam if sys.argv[5] == "adam" else torch.optim.SGD)(model.parameters(), lr=1e-2)
    first = 0
    if mode == "resume":
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = state["step"]
    options = {} if start == "auto" else {"start_step": int(start)}
    rec = Recorder(model, run_dir, flush_every_s=0.2, **options)
    for step in range(first, 60):
        torch.manual_seed(1000 + step)
        x = torch.randn(16, 8)
        if mode == "first" and step == 35:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(loss=loss)
        if mode == "first" and step == 29:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 30}, ckpt)
        if mode == "first" and step == 41:
            rec.flush()
            print("flushed", flush=True)
            sys.stdin.read()  # killed here
    rec.close()
    print("done", flush=True)
""")


def _job(jobs, workdir: str, mode: str, start: str = "auto", optimizer: str = "adam"):
    script = os.path.join(workdir, "job.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(JOB)
    return jobs.popen([sys.executable, script, os.path.join(workdir, "run"), os.path.join(workdir, "ckpt.pt"),
                       mode, start, optimizer], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, cwd=workdir)


def killed_then_resumed(jobs, workdir: str, start: str = "auto", optimizer: str = "adam") -> str:
    """Attempt 1 SIGKILLed at step 41 (after its checkpoint at 30 and its NaN at 35), then
    attempt 2 from the checkpoint, into the same run directory. Returns the run directory. Each
    attempt a process forked by ``jobs`` (tests/forked_jobs.py: the job_server or jobs fixture),
    which imported torch: the attempt imports the recorder and dies by the real SIGKILL."""
    first = _job(jobs, workdir, "first", "auto", optimizer)
    assert first.stdout.readline().strip() == "flushed", first.stderr.read()
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    assert first.returncode == -signal.SIGKILL
    for stream in (first.stdin, first.stdout, first.stderr):
        stream.close()
    second = _job(jobs, workdir, "resume", start, optimizer)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0 and out.strip() == "done", err
    return os.path.join(workdir, "run")
