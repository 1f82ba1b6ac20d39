"""A recorder fault never breaks training; odd model outputs still record; the context manager;
import hygiene; option checking."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder

from recorder_testlib import attr_str, batch, build, hooks_left, names, open_trace, train_step


def _baseline_losses(kind, n):
    model, opt = build(kind)
    return [float(train_step(model, opt, *batch(kind, s)).detach()) for s in range(n)]


def test_unwritable_run_dir_warns_once_and_training_goes_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model, opt = build("mlp")
    with pytest.warns(RuntimeWarning, match="torchautopsy"):
        rec = Recorder(model, blocker / "run")
    assert hooks_left(model) == 0  # it unhooked itself
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warns once: no more warnings, and nothing raises
        for s in range(5):
            loss = train_step(model, opt, *batch("mlp", s))
            rec.step(loss=loss)
            losses.append(float(loss.detach()))
        rec.flush()
        rec.close()
        rec.close()
    assert losses == _baseline_losses("mlp", 5)
    assert not (blocker / "run").exists()


class Boom(torch.Tensor):
    """A tensor subclass on which the recorder's own reduction fails (a stand-in for any
    unexpected internal error mid-run); every other operation works as usual."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.aminmax:
            raise RuntimeError("aminmax is not supported here")
        return super().__torch_function__(func, types, args, kwargs or {})


class BoomAt(nn.Module):
    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        if self.calls == self.at:
            x = x.as_subclass(Boom)
        self.calls += 1
        return x


def test_internal_error_mid_run_warns_once_keeps_training_and_earlier_steps(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), BoomAt(3), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # activations_every=1: every step is watched, so the module checks meet Boom at step 3.
        with Recorder(model, tmp_path / "run", flush_every_s=0.2, activations_every=1) as rec:
            for s in range(8):
                x, y = batch("mlp", s)
                loss = F.cross_entropy(model(x).as_subclass(torch.Tensor), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.step(loss=loss)
                losses.append(float(loss.detach()))
    ours = [w for w in caught if "torchautopsy" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning), [str(w.message) for w in ours]
    assert "aminmax is not supported" in str(ours[0].message)
    assert hooks_left(model) == 0
    assert len(losses) == 8 and all(np.isfinite(losses))
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert bool(f.attrs["closed"]) is True
        assert attr_str(f, "end_reason").startswith("recorder error")
        np.testing.assert_array_equal(f["steps/step"][:], [0, 1, 2])
        np.testing.assert_array_equal(f["steps/loss"][:], losses[:3])


class OddOutputs(nn.Module):
    """Submodules and a root that return dicts, integer, bool and empty tensors, and None."""

    class ReturnsNone(nn.Module):
        def forward(self, x):
            return None

    class ReturnsInts(nn.Module):
        def forward(self, x):
            return x.argmax(dim=-1), (x > 0)

    class ReturnsEmpty(nn.Module):
        def forward(self, x):
            return x[:, :0]

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.none = self.ReturnsNone()
        self.ints = self.ReturnsInts()
        self.empty = self.ReturnsEmpty()

    def forward(self, x):
        h = self.lin(x)
        self.none(h)
        idx, mask = self.ints(h)
        e = self.empty(h)
        return {"logits": h + e.sum(), "argmax": idx, "mask": mask, "nothing": None,
                "empty": e, "scalar": 3}


def test_odd_outputs_still_train_and_record(tmp_path):
    torch.manual_seed(0)
    model = OddOutputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with Recorder(model, tmp_path / "run", activations_every=1) as rec:
            for s in range(4):
                x, y = batch("mlp", s)
                loss = F.cross_entropy(model(x)["logits"], y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.step(loss=float(loss.detach()) if s % 2 else loss)  # float or tensor both accepted
                losses.append(float(loss.detach()))
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert attr_str(f, "end_reason") == "closed"
        mnames = names(f["modules/name"])
        np.testing.assert_array_equal(f["steps/step"][:], np.arange(4))
        np.testing.assert_array_equal(f["steps/loss"][:], losses)
        oabs = f["modules/output_absmax"][:]
        for n in ("none", "ints", "empty"):  # no floating output: nothing to check, -1
            assert (oabs[:, mnames.index(n)] == -1).all(), n
        for n in ("", "lin"):
            assert np.isfinite(oabs[:, mnames.index(n)]).all() and (oabs[:, mnames.index(n)] >= 0).all(), n
        assert (f["steps/nonfinite_origin"][:] == -1).all()
        np.testing.assert_array_equal(f["activations/step"][:], np.arange(4))


def test_step_without_loss_records_nan_loss(tmp_path):
    model, opt = build("mlp")
    with Recorder(model, tmp_path / "run") as rec:
        train_step(model, opt, *batch("mlp", 0))
        rec.step()
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert np.isnan(f["steps/loss"][0]) and len(f["steps/loss"]) == 1


def test_context_manager_exception_propagates_unchanged(tmp_path):
    model, opt = build("mlp")
    err = ValueError("bad batch at step 3")
    with pytest.raises(ValueError) as info:
        with Recorder(model, tmp_path / "run") as rec:
            for s in range(3):
                rec.step(loss=train_step(model, opt, *batch("mlp", s)))
            raise err
    assert info.value is err
    assert hooks_left(model) == 0
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert bool(f.attrs["closed"]) is True
        reason = attr_str(f, "end_reason")
        assert reason.startswith("exception"), reason
        assert "ValueError" in reason
        np.testing.assert_array_equal(f["steps/step"][:], [0, 1, 2])


def test_context_manager_normal_exit(tmp_path):
    model, opt = build("mlp")
    with Recorder(model, tmp_path / "run") as rec:
        rec.step(loss=train_step(model, opt, *batch("mlp", 0)))
    rec.step(loss=1.0)  # after close: ignored, never raises
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert bool(f.attrs["closed"]) is True and attr_str(f, "end_reason") == "closed"
        assert len(f["steps/step"]) == 1


@pytest.mark.slow  # subprocesses
def test_import_hygiene():
    code = textwrap.dedent("""
        import sys
        import torchautopsy
        from torchautopsy import Recorder
        assert Recorder.__name__ == "Recorder"
        heavy = [m for m in ("pandas", "matplotlib", "click", "jinja2") if m in sys.modules]
        ours = [m for m in sys.modules if m.startswith(("torchautopsy.analyzer", "torchautopsy.reports"))]
        print("HEAVY", heavy, ours)
        assert not heavy and not ours, (heavy, ours)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HEAVY [] []" in r.stdout


def test_unknown_option_is_a_type_error_naming_it(tmp_path):
    model, _ = build("mlp")
    with pytest.raises(TypeError, match="activation_every"):  # typo of activations_every
        Recorder(model, tmp_path / "run", activation_every=5)
    assert hooks_left(model) == 0
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", [{"activations_every": 0}, {"update_ratio_every": -1},
                                 {"flush_every_s": 0}, {"queue_size": 2.5}, {"cuda_history_entries": 0},
                                 {"cuda_snapshot_every": -1}, {"cuda_memory_history": "yes"},
                                 {"snapshot_every": -1}, {"snapshot_dtype": "int8"}, {"sample_rows": 0},
                                 {"histogram_every": 1.5}, {"histogram_budget": 0}, {"census_budget": 2},
                                 {"sample_modules": ["0", "no.such.layer"]}])
def test_invalid_option_values_are_rejected(tmp_path, bad):
    model, _ = build("mlp")
    with pytest.raises(ValueError, match=next(iter(bad))):
        Recorder(model, tmp_path / "run", **bad)
    assert hooks_left(model) == 0


def test_not_a_module_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="nn.Module"):
        Recorder(lambda x: x, tmp_path / "run")


def test_model_without_parameters_records(tmp_path):
    model = nn.Sequential(nn.ReLU(), nn.Tanh())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with Recorder(model, tmp_path / "run") as rec:
            for s in range(3):
                model(torch.randn(4, 3))
                rec.step(loss=float(s))
    with open_trace(tmp_path / "run" / "rank0.h5") as f:
        assert attr_str(f, "end_reason") == "closed"
        np.testing.assert_array_equal(f["steps/loss"][:], [0.0, 1.0, 2.0])
        assert names(f["params/name"]) == []
        assert f["params/grad_norm"].shape == (3, 0)
