"""What the integration tests share: a model in which NaN is born at a known step in a known
module, its batches, and readers of what the trace says about it (the real CLI for the findings,
the analyzer's export for the black box)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from tests.helpers import invoke_cli
from tests.recorder.recorder_testlib import Net

BAD_STEP = 7  # not a watched step (0, 10, 20, ...): the recorder replays it to find the module
N_STEPS = 12


# The black-box tests' model: a batch scaled by 1e3 makes `expo` overflow, BatchNorm turns Inf into NaN.
Body = Net


def batch(i: int, bad: int | None = BAD_STEP, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch i, the same in every run; batch `bad` scaled so that `expo` overflows."""
    g = torch.Generator().manual_seed(500 + i)
    x = torch.randn(n, 8, generator=g)
    if i == bad:
        x = x * 1e3
    return x, torch.randint(0, 3, (n,), generator=g)


def run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="integ_")) / "run"


def analyze(run: Path) -> list[dict]:
    """`torchautopsy analyze RUN --json OUT` with torch hidden, as on a laptop (in this process: the
    CLI's imports without torch are proved in a fresh interpreter by tests/reports/test_report_cli.py)."""
    out = run.parent / "findings.json"
    r = invoke_cli("analyze", run, "--json", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["findings"]


def assert_nan_found(run: Path, step: int = BAD_STEP, where: str = "expo") -> None:
    nonfinite = [f for f in analyze(run) if f["kind"] == "nonfinite"]
    assert len(nonfinite) == 1, nonfinite
    assert nonfinite[0]["step"] == step and nonfinite[0]["where"] == [where], nonfinite[0]


def blackbox(run: Path) -> tuple[dict, dict, dict]:
    """The black box's row, its parameters and buffers, and its other tensors (inputs, grad.*,
    optimizer.*, rng.*), read back as `torchautopsy export --params/--tensors blackbox` writes them."""
    from torchautopsy import load
    from torchautopsy.analyzer.export import safetensors_bytes, select_params, select_tensors

    rt = load(run).ranks[0]
    assert len(rt.blackbox) == 1
    row = rt.blackbox.iloc[0]
    params = load_safetensors(safetensors_bytes(select_params(rt, "blackbox")))
    tensors = load_safetensors(safetensors_bytes(select_tensors(rt, "blackbox")))
    return row, params, tensors


def assert_plain_loop_blackbox(run: Path, kept: dict, inputs: list[str], prefix: str = "",
                               optimizer: str = "Adam") -> None:
    """The black box holds what it holds in a plain loop: fired by the NaN gradients before the
    update, the parameters and buffers the bad step started from, the step's inputs, the
    affected gradients (NaN) and optimizer state (Adam's, as it was before the update).
    kept: "state" (state_dict at the start of the bad step), "exp_avg" (fc1.weight's), "inputs"
    (named by `inputs`); prefix: the path of Body's layers in the recorded model."""
    row, params, tensors = blackbox(run)
    assert int(row["step"]) == BAD_STEP
    assert row["trigger"] == "grad_nonfinite" and row["params_at"] == "start_of_step", row
    fc1 = f"{prefix}fc1.weight"
    assert fc1 in row["detail"]["affected"] and row["detail"]["optimizer"] == optimizer
    assert params.keys() == kept["state"].keys()
    for k, v in kept["state"].items():
        assert torch.equal(params[k], v), k
    for name, x in zip(inputs, kept["inputs"]):
        assert torch.equal(tensors[name], x), name
    assert not torch.isfinite(tensors[f"grad.{fc1}"]).all()
    assert torch.equal(tensors[f"optimizer.{fc1}.exp_avg"], kept["exp_avg"])
    assert "rng.torch" in tensors


# For the tests whose claim is which rank's NaN came first: a job of a few dozen ms steps on two
# cores that the suite keeps busy can have a real straggler (one rank starved by the OS for 5 steps
# in a row, 12 ms over a 35 ms step, seen under load), and the first line then rightly names it.
# Those tests read the run with the straggler detector needing more slow steps than the job has
# (a user's --config); the straggler itself is held by test_torchrun_ranks's straggler case.
NO_STRAGGLERS = "[straggler]\nmin_slow_steps = 1000\n"


def no_stragglers_config(folder: Path) -> Path:
    path = folder / "no_stragglers.toml"
    path.write_text(NO_STRAGGLERS)
    return path

