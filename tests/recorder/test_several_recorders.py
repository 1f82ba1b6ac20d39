"""Several models, each with its own Recorder, in one process (a GAN's generator and
discriminator): torch.profiler is one per process, so their profiler windows take turns.

Overlapping windows used to crash the job (exit 139 at the end of the first window: the second
profiler's stop found no session and exporting its result read a null pointer). The training runs
in a process of its own, so a crash fails the test instead of killing pytest: forked from an
interpreter that imported torch and never started a profiler (tests/forked_jobs.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from torchautopsy import Recorder, load
from tests.helpers import invoke_cli

STEPS = 24

GAN = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from torch import nn
    from torchautopsy import Recorder

    torch.manual_seed(0)
    torch.set_num_threads(1)
    root, steps = sys.argv[1], int(sys.argv[2])
    gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    disc = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    og = torch.optim.Adam(gen.parameters(), 1e-3)
    od = torch.optim.Adam(disc.parameters(), 1e-3)
    windows = dict(profile_first=3, profile_steps=2, profile_every=4)  # both due at 3, 7, 11, ...
    with Recorder(gen, f"{root}/gen", **windows) as rg, Recorder(disc, f"{root}/disc", **windows) as rd:
        for step in range(steps):
            real, z = torch.randn(16, 8) + 2.0, torch.randn(16, 8)
            fake = gen(z)
            ld = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
            od.zero_grad(); ld.backward(); od.step(); rd.step(loss=ld)
            lg = F.softplus(-disc(fake)).mean()
            og.zero_grad(); lg.backward(); og.step(); rg.step(loss=lg)
    print("trained", flush=True)
""")

# The job profiles steps 2-7 itself (stopping after rec.step(7), which asks for step 8): the
# recorder's window due at step 3 must wait for it. Then a second job starts its own profiler
# inside the recorder's window (step 4 of 3-4), which ends the window's session: the window is
# lost, and must not crash the job when it closes.
OWN_PROFILER = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from torchautopsy import Recorder

    def addmm_calls(prof):
        return len([e for e in prof.events() if e.name == "aten::addmm"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for run, (own_from, own_to) in (("run", (2, 7)), ("inside", (4, 4))):
        own = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with Recorder(model, f"{sys.argv[1]}/{run}", profile_first=3, profile_steps=2, profile_every=100) as rec:
            for step in range(12):
                if step == own_from:
                    own.start()
                loss = model(torch.randn(16, 8)).pow(2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
                if step == own_to == 4:
                    own.stop()
                rec.step(loss=loss)
                if step == own_to == 7:
                    own.stop()
        print(run, addmm_calls(own), flush=True)
""")


@pytest.fixture
def root():
    d = tempfile.mkdtemp(prefix="prof_")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _run(jobs, script: str, *args) -> subprocess.CompletedProcess:
    return jobs.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=240)


def _spans(rt) -> list[tuple[int, int]]:
    pw = rt.profile_windows
    return sorted(zip(pw["step_start"].astype(int), pw["step_end"].astype(int)))


def test_two_models_two_recorders_take_turns_at_the_profiler(jobs, root):
    r = _run(jobs, GAN, root, STEPS)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert "trained" in r.stdout
    traces = {name: load(root / name).ranks[0] for name in ("gen", "disc")}
    for name, rt in traces.items():
        assert rt.n_steps == STEPS, name
        assert list(rt.step_index) == list(range(STEPS)), name
        assert rt.closed_cleanly, name
        assert len(rt.profile_windows) >= 4, (name, _spans(rt))
        assert all(e - s == 1 for s, e in _spans(rt)), (name, _spans(rt))  # whole windows of 2 steps
        assert len(rt.profile_ops()) > 0, name
    # One window at a time: the discriminator (stepped first) opens at 3, 7, ...; the generator,
    # due at the same steps, waits for it to close and says so in its trace.
    disc, gen = _spans(traces["disc"]), _spans(traces["gen"])
    assert disc[0] == (3, 4) and gen[0] == (5, 6), (disc, gen)
    for s, e in gen:
        assert all(e < s2 or e2 < s for s2, e2 in disc), (gen, disc)
    note = traces["gen"].meta.get("profile_note", "")
    assert "deferred" in note and "another" in note, note
    for name in ("gen", "disc"):
        a = invoke_cli("analyze", root / name)
        assert a.returncode in (0, 1), (name, a.returncode, a.stdout[-2000:], a.stderr[-2000:])


def test_a_window_waits_for_the_jobs_own_profiler(jobs, root):
    r = _run(jobs, OWN_PROFILER, root)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-4000:]}"
    calls = dict(line.split() for line in r.stdout.split("\n") if line)
    assert int(calls["run"]) == 6 * 2  # its six steps, two Linear layers: untouched by the recorder
    assert int(calls["inside"]) == 2  # its one step
    rt = load(root / "run").ranks[0]
    assert rt.n_steps == 12
    assert _spans(rt) == [(9, 10)]  # due at 3; opened at the first step boundary after the job's stop
    assert "deferred" in rt.meta["profile_note"] and "the job's own torch.profiler" in rt.meta["profile_note"]
    rt = load(root / "inside").ranks[0]
    assert rt.n_steps == 12 and len(rt.profile_windows) == 0
    assert "1 profiler window(s) lost" in rt.meta["profile_note"]


def test_two_recorders_in_the_same_run_dir_are_refused(root):
    """Both would write rank0.h5 (or the second a restart's file of the same rank, mixing two
    models on one step axis): the second warns and records nothing, the first records on."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 1)
    with Recorder(a, root, profile_steps=0) as rec:
        with pytest.warns(RuntimeWarning, match="its own run directory"):
            Recorder(b, root, profile_steps=0)
        for _ in range(2):
            a(torch.randn(2, 4)).sum().backward()
            rec.step(loss=0.0)
    assert [p.name for p in root.iterdir()] == ["rank0.h5"]
    assert load(root).ranks[0].n_steps == 2


class _NoNorm(torch.Tensor):
    """A gradient the recorder cannot measure (its norm raises): the recorder fails inside the
    optimizer's pre-hook."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if "norm" in getattr(func, "__name__", ""):
            raise RuntimeError("norm is not supported on this gradient")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_recorder_failing_inside_the_optimizer_hook_leaves_the_others_and_training_alone(root):
    """One Recorder fails in its optimizer pre-hook and unhooks itself while torch iterates its
    global hooks: that raised 'OrderedDict mutated during iteration' into the loop. Now training
    goes on unchanged and the other Recorder records every step."""
    def train(record: bool):
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 1)
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        ra, rb = (Recorder(a, root / "a"), Recorder(b, root / "b")) if record else (None, None)
        losses = []
        for s in range(5):
            loss = b(a(torch.randn(8, 4))).square().mean()
            oa.zero_grad()
            ob.zero_grad()
            loss.backward()
            if s == 2:
                a.weight.grad = a.weight.grad.as_subclass(_NoNorm)
            oa.step()
            ob.step()
            losses.append(float(loss.detach()))
            if record:
                ra.step(loss=loss)
                rb.step(loss=loss)
        if record:
            ra.close()
            rb.close()
        return losses

    with pytest.warns(RuntimeWarning, match="recorder error .*norm is not supported"):
        recorded = train(True)
    assert recorded == train(False)
    assert list(load(root / "b").ranks[0].steps.index) == [0, 1, 2, 3, 4]
    assert list(load(root / "a").ranks[0].steps.index) == [0, 1]


def test_a_second_recorder_into_the_same_run_directory_warns_and_records_nothing(tmp_path):
    """Issue 38 (2): it raised ValueError into the job; every other recorder error warns once and
    stops recording. The first Recorder keeps its file and every step."""
    import warnings

    torch.manual_seed(0)
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(model, tmp_path) as first, Recorder(other, tmp_path) as second:
            for _ in range(5):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                first.step(loss=loss)
                second.step(loss=loss)
    ours = [str(w.message) for w in caught if "torchautopsy" in str(w.message)]
    assert len(ours) == 1 and "another Recorder in this process" in ours[0] and "\n" not in ours[0], ours
    rt = load(tmp_path).ranks[0]
    assert rt.closed_cleanly and rt.n_steps == 5 and rt.param_names == ["weight", "bias"]
