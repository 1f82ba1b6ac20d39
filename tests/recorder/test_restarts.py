"""A job pre-empted and restarted into its run directory: each attempt keeps its own file, the
restart's step numbers continue the checkpoint's, and load() reads the attempts as one timeline
in which a failure of an abandoned attempt is still found. Real training in processes of their
own (forked from an interpreter that imported torch: tests/forked_jobs.py), killed with SIGKILL;
real HDF5 files."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import warnings

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from torchautopsy import Recorder, load
from torchautopsy.analyzer.run import analyze

from tests.recorder.recorder_testlib import killed_then_resumed

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

@pytest.fixture
def workdir():
    d = tempfile.mkdtemp(prefix="restart_")
    yield d
    shutil.rmtree(d, ignore_errors=True)  # (this test's own directory only)


def _attrs(path: str) -> dict:
    with h5py.File(path, "r", swmr=True) as f:
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}


def _steps(path: str) -> list[int]:
    with h5py.File(path, "r", swmr=True) as f:
        return [int(s) for s in f["steps/step"][:]]


@pytest.mark.parametrize("start, optimizer", [("auto", "adam"), ("30", "sgd")])
def test_a_killed_job_restarted_from_its_checkpoint_keeps_both_attempts(jobs, workdir, start, optimizer):
    """Adam: the resumed step is read from the optimizer's state; SGD keeps none: start_step=."""
    run = killed_then_resumed(jobs, workdir, start, optimizer)
    first, second = os.path.join(run, "rank0.h5"), os.path.join(run, "rank0.attempt2.h5")
    assert sorted(os.listdir(run)) == ["rank0.attempt2.h5", "rank0.h5"]
    a1, a2 = _attrs(first), _attrs(second)
    assert a1["attempt"] == 1 and a1["previous_file"] == "" and not a1["closed"]  # killed
    assert a2["attempt"] == 2 and a2["previous_file"] == "rank0.h5" and a2["closed"]
    assert _steps(first) == list(range(42)) and _steps(second) == list(range(30, 60))
    assert a2["first_step"] == 30 and a2["n_steps_recorded"] == 30
    # Everything of attempt 2 counts from step 30: its opening snapshot (the checkpoint's weights),
    # its activity windows and samples.
    ckpt = torch.load(os.path.join(workdir, "ckpt.pt"))["model"]
    rt2 = load(second).ranks[0]
    assert int(rt2.snapshots["step"].iloc[0]) == 30
    opening = rt2.tensors_of("snapshot", 30)
    assert sorted(opening["name"]) == sorted(ckpt)
    for key, raw in zip(opening["name"], rt2.read_tensor_bytes(opening, verify_snapshot=30)):
        stored = np.frombuffer(raw, dtype=np.float32).reshape(ckpt[key].shape)
        assert np.array_equal(stored, ckpt[key].numpy()), key
    windows = list(rt2.activity_windows())
    assert windows[0][0] == 30 and min(rt2.sample_steps("activations")) == 30
    assert min(rt2.sample_steps("updates")) == 31  # against weights copied at the end of step 30

    trace = load(run)
    rt = trace.ranks[0]
    assert list(rt.step_index) == list(range(60)) and rt.n_steps == 60
    assert [a.file for a in trace.attempts[0]] == ["rank0.h5", "rank0.attempt2.h5"]
    assert [a.kept for a in trace.attempts[0]] == [30, 30]
    loss = rt.steps["loss"]
    assert np.isfinite(loss.to_numpy()).all()  # steps 30-59 are attempt 2's: no NaN
    mine = load(first).ranks[0].steps["loss"]
    assert np.array_equal(loss.loc[:29].to_numpy(), mine.loc[:29].to_numpy())
    assert np.isnan(mine.loc[35])
    assert rt.param_stat("grad_norm").shape == (60, 4)
    assert list(rt.param_stat("grad_norm", rows=[5, 29, 30, 59]).index) == [5, 29, 30, 59]
    assert np.allclose(rt.digest.total_grad_norm[30:], load(second).ranks[0].digest.total_grad_norm)
    # Reads by rows, backwards and bucketed agree with the whole table, across the restart.
    whole = rt.param_stat("grad_norm")
    back = rt.param_stat("grad_norm", rows=slice(None, None, -1))
    assert list(back.index) == list(range(59, -1, -1)) and np.array_equal(back.to_numpy()[::-1], whole.to_numpy())
    b = rt.bucketed("params/grad_norm", np.array([0, 10, 30, 45, 60]))
    for k, (lo, hi) in enumerate([(0, 10), (10, 30), (30, 45), (45, 60)]):
        assert np.allclose(b["max"][k], whole.to_numpy()[lo:hi].max(axis=0))
    # Samples: attempt 1's below step 30, attempt 2's from it.
    act = rt.activation_stat("mean")
    own = [load(p).ranks[0].sample_steps("activations") for p in (first, second)]
    assert list(act.index) == [s for s in own[0] if s < 30] + list(own[1])
    assert list(rt.update_ratio().index) == list(rt.sample_steps("updates"))

    # The NaN of the abandoned attempt is found, at its step, and says which attempt.
    bad = [f for f in analyze(trace) if f.kind == "nonfinite"]
    assert bad and bad[0].step == 35
    assert bad[0].evidence["attempt"] == 1 and bad[0].evidence["file"] == "rank0.h5"
    assert bad[0].evidence["rerun_from_step"] == 30 and bad[0].summary.startswith("Attempt 1 (rank0.h5")


def test_an_earlier_trace_is_never_written_over(workdir):
    """A second Recorder on the directory gets rank0.attempt2.h5; rank0.h5 keeps every byte. A
    name left by a job killed while it started (a .starting reservation) is skipped."""
    run = os.path.join(workdir, "run")
    model = nn.Linear(4, 2)

    def record(n, **options):
        with Recorder(model, run, **options) as rec:
            for _ in range(n):
                rec.step(loss=model(torch.randn(2, 4)).square().mean())
        return rec.path

    assert os.path.basename(record(80)) == "rank0.h5"
    digest = hashlib.sha256(open(os.path.join(run, "rank0.h5"), "rb").read()).hexdigest()
    assert os.path.basename(record(30)) == "rank0.attempt2.h5"
    open(os.path.join(run, "rank0.attempt3.h5.starting"), "w").close()  # died in its first 50 ms
    assert os.path.basename(record(5, start_step=np.int64(7))) == "rank0.attempt4.h5"
    assert hashlib.sha256(open(os.path.join(run, "rank0.h5"), "rb").read()).hexdigest() == digest
    assert _steps(os.path.join(run, "rank0.h5")) == list(range(80))
    assert _steps(os.path.join(run, "rank0.attempt4.h5")) == list(range(7, 12))
    assert _attrs(os.path.join(run, "rank0.attempt4.h5"))["previous_file"] == "rank0.attempt2.h5"
    trace = load(run)
    # attempt 2 started over at 0 (no optimizer, no start_step): the timeline is its steps 0-6,
    # then attempt 4's; attempt 1 is all run again, and still analyzed
    assert list(trace.ranks[0].step_index) == list(range(12))
    assert [a.kept for a in trace.attempts[0]] == [0, 7, 5]
    assert any("rank0.attempt3.h5.starting" in why for why in trace.unreadable.values())


def _race(run: str, barrier, i: int) -> None:
    torch.set_num_threads(1)
    model = nn.Linear(4, 2)
    barrier.wait()
    rec = Recorder(model, run)
    for _ in range(3):
        rec.step(loss=float(i))
    rec.close()


def test_processes_starting_together_take_distinct_names(workdir):
    run = os.path.join(workdir, "run")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_race, args=(run, barrier, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    names = sorted(os.listdir(run))
    assert names == ["rank0.attempt2.h5", "rank0.attempt3.h5", "rank0.attempt4.h5", "rank0.h5"]
    losses = set()
    for n in names:
        with h5py.File(os.path.join(run, n), "r") as f:
            assert f.attrs["closed"]
            losses.add(float(f["steps/loss"][0]))
    assert losses == {0.0, 1.0, 2.0, 3.0}  # each process's steps in a file of its own


class _OddState(torch.optim.Optimizer):
    """An optimizer whose state holds a 'step' the recorder cannot read as a number."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["step"] = object()
                p -= g["lr"] * p.grad


def test_an_unreadable_optimizer_step_never_reaches_training(workdir):
    def train(run):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = _OddState(model.parameters())
        for p in model.parameters():
            opt.state[p]["step"] = object()
        rec = Recorder(model, run) if run else None
        losses = []
        for _ in range(5):
            loss = model(torch.ones(2, 4)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rec:
                rec.step(loss=loss)
            losses.append(float(loss))
        if rec:
            rec.close()
        return losses

    Recorder(nn.Linear(4, 1), os.path.join(workdir, "run")).close()  # a first attempt: this is a restart
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorded = train(os.path.join(workdir, "run"))
    assert recorded == train(None)
    assert any("recorder error" in str(w.message) for w in caught)


def test_start_step_is_validated(workdir):
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="start_step"):
            Recorder(nn.Linear(2, 2), os.path.join(workdir, "run"), start_step=bad)


def test_a_first_attempt_counts_from_zero_whatever_the_optimizer_did_before(workdir):
    """Recording starts late in a job (Adam has taken 7 steps): no earlier attempt in the run
    directory, so the first rec.step() is step 0, as the README says; start_step= still wins."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(n, rec=None):
        for _ in range(n):
            loss = model(torch.randn(8, 4)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rec:
                rec.step(loss=loss)

    train(7)
    rec = Recorder(model, os.path.join(workdir, "late"))
    train(3, rec)
    rec.close()
    assert _steps(rec.path) == [0, 1, 2] and os.path.basename(rec.path) == "rank0.h5"
    rec = Recorder(model, os.path.join(workdir, "given"), start_step=10)
    train(2, rec)
    rec.close()
    assert _steps(rec.path) == [10, 11]
