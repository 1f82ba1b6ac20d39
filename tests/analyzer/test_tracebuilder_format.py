"""tests/tracebuilder.py writes the format the recorder writes: same groups, datasets, dtypes
and root attributes as a trace recorded from a real (tiny) training run; and it works, with the
real CLI reading its output, where torch cannot be imported."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.helpers import REPO, run_cli
from tests.tracebuilder import LAYOUT, TraceBuilder

# The recorder's "not measured" / "nothing happened" values, compared on a step it did not watch.
SENTINEL_COLUMNS = ("steps/nonfinite_origin", "steps/batch_nonfinite", "steps/nonfinite_consumer",
                    "steps/output_grad_nonfinite", "steps/live_tensors", "steps/live_tensor_bytes",
                    "steps/live_tensors_with_graph", "steps/cuda_allocated_bytes", "steps/cuda_reserved_bytes",
                    "steps/cuda_peak_bytes", "steps/loss_scale", "params/grad_absmax", "params/grad_nonfinite",
                    "params/param_norm", "modules/output_absmax")
UNWATCHED_STEP = 5


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    """A 3-layer MLP trained 12 steps with the Recorder (CPU, under a second)."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from tests.training import train

    run_dir = tmp_path_factory.mktemp("real")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    train(model, run_dir, 12, lambda step: torch.randn(16, 4), lambda out: ((out - 1) ** 2).mean())  # SGD, lr 0.01
    return run_dir / "rank0.h5"


def built_trace(run_dir):
    """A builder trace with every table it supports holding rows."""
    b = TraceBuilder.mlp(layers=3, steps=12).loss(np.linspace(1.0, 0.5, 12)).total_grad_norm(1.0)
    b.set("steps/rss_bytes", 2**30).set("steps/lr", 0.01).set("steps/optimizer_steps", 1)
    b.activations([0, 10], mean={"0": 0.1}, std={"0": 1.0}).updates([0, 10], {"0.weight": 1e-3})
    b.activity_site("1", units=8).activity_site("3", units=8).activity_window(0, 4).activity_window(5, 11)
    b.attention_site("2", heads=2).attention([0, 10], entropy={"2": 0.5})
    b.census(0, count=3, bytes=12).row("module_outputs", module="0", shape="[16, 8]", dtype="float32",
                                         grad_fn="AddmmBackward0")
    b.row("loss_checks", step=3, outputs_nonfinite=0, ops="[]")
    b.row("hyperparams", step=0, optimizer=0, group=0, name="lr", value=0.01)
    b.row("optimizers", optimizer=0, **{"class": "SGD"}, first_step=0)
    return b.write(run_dir)


def layout(path) -> dict:
    """{dataset: (dtype kind, "str" for strings), ndim, chunked)} and {group: None}, and the root attributes."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Group):
                out[name] = None
            else:
                kind = "str" if h5py.check_string_dtype(obj.dtype) else obj.dtype.str
                out[name] = (kind, obj.ndim, obj.chunks is not None)
        f.visititems(visit)
        attrs = {k: _attr_kind(v) for k, v in f.attrs.items()}
    return out, attrs


def _attr_kind(v) -> str:
    if isinstance(v, (str, bytes)):
        return "str"
    return np.asarray(v).dtype.kind


def test_builder_writes_what_the_recorder_writes(real_trace, tmp_path):
    real, real_attrs = layout(real_trace)
    built, built_attrs = layout(built_trace(tmp_path))
    # Every dataset the builder writes exists in the real trace, same dtype, rank and storage.
    for name, what in built.items():
        assert name in real, f"the builder writes {name}, which the recorder does not"
        assert what == real[name], f"{name}: builder {what}, recorder {real[name]}"
    # Each table it writes, it writes whole: a column the recorder adds fails here, not in a detector.
    for group in (n for n, v in built.items() if v is None):
        want = {n for n in real if n.startswith(group + "/")}
        assert want <= set(built), f"{group}: the builder lacks {sorted(want - set(built))}"
    assert set(LAYOUT) == {n for n, v in built.items() if v is None}
    # The same root attributes, of the same types.
    assert built_attrs == real_attrs


def test_builder_defaults_are_the_recorders_not_measured_values(real_trace, tmp_path):
    b = TraceBuilder.mlp(layers=3, steps=12)
    with h5py.File(b.write(tmp_path), "r") as built, h5py.File(real_trace, "r") as real:
        for name in SENTINEL_COLUMNS:
            np.testing.assert_array_equal(built[name][UNWATCHED_STEP], real[name][UNWATCHED_STEP], err_msg=name)
        assert built.attrs["format"] == real.attrs["format"]
        assert built.attrs["schema_version"] == real.attrs["schema_version"]
        assert [n.decode() for n in built["modules/name"][()]] == [n.decode() for n in real["modules/name"][()]]
        assert list(built["modules/is_leaf"][()]) == list(real["modules/is_leaf"][()])


def test_builder_trace_reads_like_a_recorded_one(real_trace, tmp_path):
    from torchautopsy import load

    built_trace(tmp_path)
    built = load(tmp_path).ranks[0]
    real = load(real_trace.parent).ranks[0]
    assert built.n_steps == real.n_steps == 12 and built.closed_cleanly and real.closed_cleanly
    assert built.param_names == real.param_names and built.module_types == real.module_types
    assert list(built.steps.columns) == list(real.steps.columns)
    assert built.activity_sites.columns.tolist() == real.activity_sites.columns.tolist()
    assert built.n_samples("activations") == real.n_samples("activations") == 2


BUILD_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
sys.path.insert(0, sys.argv[1])
import numpy as np
from tests.tracebuilder import TraceBuilder
b = TraceBuilder.mlp(layers=3, steps=60).loss(np.linspace(2.0, 1.0, 60)).total_grad_norm(1.0)
b.loss(np.nan, at=slice(37, None)).set("params/grad_norm", np.nan, at=slice(37, None))
b.set("params/grad_nonfinite", 4, at=slice(37, None)).set("steps/nonfinite_origin", b.module_index("2"), at=37)
b.set("modules/output_absmax", np.nan, at=37, col=["2", "3", "4"])
b.write(sys.argv[2])
assert sys.modules["torch"] is None and not [m for m in sys.modules if m.startswith("torchautopsy.recorder")]
"""


@pytest.mark.slow  # a subprocess without torch
def test_builder_and_cli_without_torch(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "findings.json"
    built = subprocess.run([sys.executable, "-c", BUILD_WITHOUT_TORCH, str(REPO), str(run_dir)],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    r = run_cli("analyze", run_dir, "--json", out, "--fail-on", "error", block_torch=True)
    assert r.returncode == 1, r.stdout + r.stderr  # 1: a finding reached --fail-on
    found = json.loads(out.read_text())["findings"]
    assert not [f for f in found if f["kind"] == "analyzer_error"]
    (nan,) = [f for f in found if f["kind"] == "nonfinite"]
    assert (nan["severity"], nan["step"], nan["where"]) == ("error", 37, ["2"])
