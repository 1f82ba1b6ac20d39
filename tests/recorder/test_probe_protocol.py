"""Issue 40 (3): the probes have one protocol (recorder/probe.py) that the conductor loops over.

- every probe the Recorder builds is a ``Probe`` and is armed, aligned and closed through it;
- a resumed attempt lines its probes up through ``align`` (no private fields set from outside);
- no module in recorder/ assigns the attributes of another object, but for the few listed
  below, each with its reason (a probe's own records, ctypes, the functions that
  forward/wrapped_functions.py wraps);
- Heartbeat, ExitHooks, the wrapped functions' observer and the update guard take callables,
  not the Recorder.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import torch
from torch import nn

from torchautopsy import Recorder
from torchautopsy.recorder import probe
from torchautopsy.recorder.distributed import heartbeat
from torchautopsy.recorder.forward import wrapped_functions
from torchautopsy.recorder.optimizer import update_guard
from torchautopsy.recorder.trace_file import exit_hooks

RECORDER = Path(__file__).resolve().parents[2] / "recorder"

# (module's path under recorder/, the object whose attribute it sets) -> why that is not reaching
# into another object
ALLOWED = {
    ("forward/unit_activity.py", "s"): "the tracker's own site records (_Site)",
    ("forward/unit_activity.py", "site"): "the tracker's own site records (_Site)",
    ("forward/attention_capture.py", "site"): "the tracker's own site records (_Site)",
    ("forward/wrapped_functions.py", "wrapper"): "the wrappers it makes",
    ("forward/wrapped_functions.py", "__next__"): "the wrapper it makes",
    ("forward/wrapped_functions.py", "_state"): "its thread-local call depth",
    ("forward/wrapped_functions.py", "it"): "DataLoader's __next__, wrapped: its job",
    ("forward/wrapped_functions.py", "ns"): "torch.nn.functional's functions, wrapped: its job (setattr)",
    ("forward/module_watcher.py", "self._unmeasured.flags"): "numpy's read-only flag of its own array",
    ("optimizer/param_stats.py", "self.unmeasured.flags"): "numpy's read-only flag of its own array",
    ("optimizer/param_stats.py", "self.no_bad_grads.flags"): "numpy's read-only flag of its own array",
    ("distributed/local_grads.py", "g"): "FSDP2's reduce-scatter communication, wrapped",
    ("memory/readings.py", "task_info"): "ctypes prototypes",
    ("memory/readings.py", "kernel32.GetCurrentProcess"): "ctypes prototypes",
    ("memory/readings.py", "get"): "ctypes prototypes",
    ("memory/readings.py", "counters"): "a ctypes structure it fills",
    ("memory/readings.py", "count"): "a ctypes value it passes",
    ("memory/memory_probe.py", "probe"): "itself, through the weak reference its gc callback holds",
    ("profiler/profile_windows.py", "_quiet_kineto"): "a function's own once-flag",
    ("profiler/profile_windows.py", "self._exported.pop()"): "torch.profiler's result, released (benchmarks/README.md, glibc)",
    ("profiler/profile_windows.py", "cls"): "its own class",
    ("profiler/profile_windows.py", "flag"): "a ctypes value",
    ("blackbox/replay.py", "p"): "the gradients of its own copy of the model",
    ("trace_file/writer.py", "self._f"): "h5py's SWMR switch of its own file",
}


def _foreign_assignments(path: Path) -> list[tuple[str, str, int]]:
    """(module's path under recorder/, object, line) of every assignment to an attribute of an
    object other than self."""
    module = path.relative_to(RECORDER).as_posix()
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
            if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                out.append((module, ast.unparse(t.value), node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            out.append((module, ast.unparse(node.args[0]), node.lineno))
    return out


def test_no_recorder_module_sets_the_fields_of_another_object():
    scanned = sorted(p for p in RECORDER.rglob("*.py") if "__pycache__" not in p.parts)
    assert {p.relative_to(RECORDER).as_posix() for p in scanned} >= set(recorder_modules())  # subpackages too
    found = [a for p in scanned for a in _foreign_assignments(p)]
    reaching = [f"{m}:{line}: {obj}.<attr> = ..." for m, obj, line in found if (m, obj) not in ALLOWED]
    assert not reaching, "ask the object (a method, the probe protocol) instead:\n" + "\n".join(reaching)
    stale = set(ALLOWED) - {(m, obj) for m, obj, _ in found}
    assert not stale, f"allowed but no longer there: {sorted(stale)}"


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _train(rec: Recorder, model: nn.Module, opt, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec.step(loss=loss)


def test_every_probe_the_recorder_builds_keeps_the_protocol_and_is_armed_and_closed_through_it(tmp_path,
                                                                                              monkeypatch):
    calls: dict[str, list] = {"arm": [], "close": []}
    for name in calls:
        for cls in {type(p) for p in _probes_of_a_recorder(tmp_path / "probe")}:
            own = cls.__dict__.get(name)
            if own is None:
                continue

            def spy(self, *args, _own=own, _name=name):
                calls[_name].append(type(self).__name__)
                return _own(self, *args)
            monkeypatch.setattr(cls, name, spy)
    model = _model()
    rec = Recorder(model, tmp_path / "run")
    probes = rec._probes
    assert probes and all(isinstance(p, probe.Probe) for p in probes)
    for p in probes:  # each is a probe in earnest: it overrides a call of the protocol
        assert any(name in type(p).__dict__ for name in probe.PROTOCOL), type(p).__name__
    _train(rec, model, torch.optim.SGD(model.parameters(), lr=0.01), 3)
    armed = {type(p).__name__ for p in probes if "arm" in type(p).__dict__}
    assert set(calls["arm"]) == armed
    rec.close()
    closing = {type(p).__name__ for p in probes if "close" in type(p).__dict__}
    assert set(calls["close"]) == closing


def _probes_of_a_recorder(run_dir) -> tuple:
    rec = Recorder(_model(), run_dir)
    probes = rec._probes
    rec.close()
    return probes


def test_a_resumed_attempt_aligns_each_probe_through_the_protocol(tmp_path, monkeypatch):
    aligned: list[tuple[str, int]] = []
    for cls in {type(p) for p in _probes_of_a_recorder(tmp_path / "probe")}:
        own = cls.__dict__.get("align")
        if own is not None:
            def spy(self, step, _own=own):
                aligned.append((type(self).__name__, step))
                return _own(self, step)
            monkeypatch.setattr(cls, "align", spy)
    model = _model()
    (tmp_path / "run").mkdir()
    Recorder(model, tmp_path / "run").close()  # a first attempt: this one is a restart
    opt = torch.optim.Adam(model.parameters())
    _train_bare(model, opt, 5)  # the checkpoint's optimizer: 5 steps
    rec = Recorder(model, tmp_path / "run")
    assert aligned == [] and rec._step == 0  # not known until the optimizer steps
    _train(rec, model, opt, 2)
    want = {type(p).__name__ for p in rec._probes if "align" in type(p).__dict__}
    assert {n for n, _ in aligned} == want and {s for _, s in aligned} == {5}
    assert rec._step == 7 and rec.activity.step == 7  # (armed for the coming step, 7)
    rec.close()


def _train_bare(model, opt, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_the_recorders_helpers_take_callables_not_the_recorder():
    for cls in (heartbeat.Heartbeat, exit_hooks.ExitHooks, update_guard.UpdateGuard):
        params = inspect.signature(cls.__init__).parameters
        assert "rec" not in params and "recorder" not in params, cls.__name__
    fields = wrapped_functions.Observer.__dataclass_fields__
    assert set(fields) == {"on_activation", "on_attention", "on_data_wait", "on_observer_error"}


def recorder_modules() -> list[str]:
    """Every module of recorder/ and of its subpackages, as its path under recorder/."""
    return sorted(p.relative_to(RECORDER).as_posix() for p in RECORDER.rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def recorder_subpackages() -> list[str]:
    return sorted(p.parent.relative_to(RECORDER).as_posix() for p in RECORDER.rglob("__init__.py")
                  if p.parent != RECORDER)


def _inside_the_recorder(doc: str) -> str:
    inside = doc[doc.index("## Inside the recorder"):]
    return inside[:inside.index("\n## ", 1)]


def test_every_recorder_module_is_in_the_architecture_docs_map():
    """docs/architecture.md's "Inside the recorder" names every module of recorder/ and of its
    subpackages by its path under recorder/ (`forward/module_watcher.py`), and every subpackage
    (`forward/`), so that the map stays complete as modules come, go and move."""
    inside = _inside_the_recorder((RECORDER.parent / "docs" / "architecture.md").read_text())
    modules = recorder_modules()
    assert "forward/module_watcher.py" in modules and "recorder.py" in modules  # (the walk reaches both)
    missing = [m for m in modules if f"`{m}`" not in inside]
    assert not missing, f"not in docs/architecture.md's map of the recorder: {missing}"
    folders = recorder_subpackages()
    assert "forward" in folders and "integrations" in folders
    unnamed = [f for f in folders if f"`{f}/`" not in inside]
    assert not unnamed, f"subpackages not in docs/architecture.md's map of the recorder: {unnamed}"


def test_the_docs_map_names_no_module_that_is_gone():
    """The map's module paths all exist: a module renamed or moved is renamed in the map too.
    (Paths under another folder of the repository, `tests/...`, are not the recorder's.)"""
    inside = _inside_the_recorder((RECORDER.parent / "docs" / "architecture.md").read_text())
    others = {p.name for p in RECORDER.parent.iterdir() if p.is_dir()} - {"recorder"}
    named = {n.removeprefix("recorder/") for n in re.findall(r"`((?:\w+/)*\w+\.py)`", inside)}
    gone = sorted(n for n in named - set(recorder_modules()) - {"__init__.py"} if n.split("/")[0] not in others)
    assert not gone, f"docs/architecture.md's map names modules recorder/ does not have: {gone}"


def test_the_recorders_folders_hold_modules_not_code():
    """A subpackage's __init__.py is its docstring only: importing a folder costs nothing the
    Recorder would not import anyway (the recorder must import fast)."""
    for folder in recorder_subpackages():
        body = ast.parse((RECORDER / folder / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), folder
