"""The recorder writes the trace and the analyzer reads it, and neither imports the other (the
trace file is the only interface: docs/architecture.md). So the schema is spelled on both sides, and this
test holds them together: the constants agree, and every dataset the analyzer asks for is one the
writer writes (or an older format's, listed here)."""

from __future__ import annotations

import glob
import posixpath
import tempfile

import h5py
import torch
from torch import nn

from tests.training import squared, train
from torchautopsy import load
from torchautopsy.analyzer import memory_snapshot
from torchautopsy.analyzer.run import analyze
from torchautopsy.analyzer.trace import format as reader_format
from torchautopsy.analyzer.trace import upgrade
from torchautopsy.recorder.forward import module_watcher
from torchautopsy.recorder.memory import cuda_allocator
from torchautopsy.recorder.trace_file import attempts, schema

# Datasets of older formats that the reader still looks for (and upgrades): not written today.
LEGACY = set()


def test_constants_agree():
    assert schema.SCHEMA_VERSION == reader_format.SCHEMA_VERSION
    assert schema.FORMAT_NAME == reader_format.FORMAT_NAME
    assert schema.OWN_WORK_RANGE == reader_format.OWN_WORK_RANGE
    assert module_watcher.MAX_SITE_CALLS == reader_format.MAX_SITE_CALLS
    assert attempts.STARTING_SUFFIX == reader_format.STARTING_SUFFIX
    for key in ("SNAPSHOT_KEYS", "SEGMENT_KEYS", "BLOCK_KEYS", "TRACE_KEYS", "FRAME_KEYS"):
        assert getattr(cuda_allocator, key) == getattr(memory_snapshot, key), key


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.act = nn.GELU()  # called twice: per-call sites (call_sites/, call_outputs/)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 1), nn.Tanh())

    def forward(self, x):
        h = self.act(self.embed(x))
        h, _ = self.attn(h, h, h)
        h = self.act(h)
        return self.head(h).mean(1)


def _recorded_run() -> str:
    """A run that fills every table a CPU job can: watched steps, activity, attention,
    histograms, samples, census, a profiler window, update ratios, snapshots, a black box."""
    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        x = torch.randn(4, 6, 8)
        if step == 25:
            x[0, 0, 0] = float("nan")
        return x

    return train(model, tempfile.mkdtemp(prefix="schema_"), 30, batch, squared, optimizer=opt, activations_every=1,
                 activity_window=5, histogram_every=5, sample_every=5, census_every=5, update_ratio_every=5,
                 snapshot_every=10)


def test_every_dataset_the_analyzer_reads_is_one_the_writer_writes(monkeypatch):
    run = _recorded_run()
    with h5py.File(glob.glob(f"{run}/rank0.h5")[0], "r") as f:
        written = set()
        f.visit(written.add)
    layout = schema.table_layout(1, 1, 1, 1, 1)
    can_write = {f"{t}/{c.name}" for t, cols in layout.items() for c in cols} | set(layout)

    asked = set()
    get, contains = h5py.Group.__getitem__, h5py.Group.__contains__

    def full(group, name):
        return posixpath.join(group.name, name).lstrip("/") if isinstance(name, str) else None

    def spy_get(self, name):
        asked.add(full(self, name))
        return get(self, name)

    def spy_contains(self, name):
        asked.add(full(self, name))
        return contains(self, name)

    monkeypatch.setattr(h5py.Group, "__getitem__", spy_get)
    monkeypatch.setattr(h5py.Group, "__contains__", spy_contains)
    trace = load(run)
    findings = analyze(trace)
    rt = trace.ranks[0]
    for prop in ("stored_tensors", "blackbox", "snapshots", "census_groups", "module_outputs",
                 "profile_windows", "loss_checks", "hyperparams", "optimizers", "call_sites"):
        getattr(rt, prop)
    for stat in ("output_absmax", "mean", "std", "zero_frac"):
        assert rt.call_stat(stat).shape[1] == 2  # (act#0, act#1)
    monkeypatch.undo()

    assert any(f.kind == "nonfinite" for f in findings)
    assert len(asked) > 50, sorted(asked)  # the spy saw the reads
    asked -= {None, ""}  # (the root group)
    unknown = sorted(p for p in asked if p not in written and p not in can_write and p not in LEGACY)
    assert not unknown, f"the analyzer reads datasets the recorder never writes: {unknown}"
    # The datasets the reader fills in for older traces are all ones the recorder writes today.
    assert set(upgrade.ADDED) <= written | can_write, set(upgrade.ADDED) - written - can_write
