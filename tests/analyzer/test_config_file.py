"""Thresholds from a TOML file: load_config, and `torchautopsy analyze --config` through the CLI
(in this process: tests.helpers.invoke_cli)."""

import dataclasses
import json
import sys

import pytest
import torch

from tests.analyzer.training_runs import mlp, teacher_data, train
from tests.helpers import invoke_cli
from torchautopsy.analyzer.config import AnalysisConfig
from torchautopsy.analyzer.config_file import load_config
from torchautopsy.analyzer.errors import ConfigError, TraceError


def write(tmp_path, text, name="thresholds.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_file_sets_what_it_names_and_nothing_else(tmp_path):
    p = write(tmp_path, "[exploding_gradients]\nsustained_ratio = 50\n\n"
                        "[update_ratio]\ntoo_large = 0.2\nmin_samples = 4\n")
    cfg = load_config(p)
    default = AnalysisConfig()
    assert cfg.exploding_gradients.sustained_ratio == 50.0
    assert isinstance(cfg.exploding_gradients.sustained_ratio, float)  # TOML int for a float field
    assert cfg.update_ratio.too_large == 0.2 and cfg.update_ratio.min_samples == 4
    assert cfg.update_ratio.too_small == default.update_ratio.too_small
    assert dataclasses.replace(cfg, exploding_gradients=default.exploding_gradients,
                               update_ratio=default.update_ratio) == default
    assert load_config(write(tmp_path, "# nothing to change\n", "empty.toml")) == default


@pytest.mark.parametrize("text, needles", [
    ("[update_ratio]\ntoo_larg = 0.2\n", ["[update_ratio]", "'too_larg'", "too_large, too_small"]),
    ("[update_ratios]\ntoo_large = 0.2\n", ["[update_ratios]", "[update_ratio]", "[loss_plateau]"]),
    ('[update_ratio]\ntoo_large = "big"\n', ["[update_ratio] too_large", "must be a number", "'big'"]),
    ("[loss_divergence]\nwindow = 2.5\n", ["[loss_divergence] window", "must be an integer"]),
    ("[loss_plateau]\ntail_frac = 2\n", ["[loss_plateau]", "tail_frac", "between 0.0 and 1.0"]),
    ("[update_ratio]\ntoo_small = 0.5\n", ["[update_ratio]", "too_small", "below too_large"]),
    ("[nonfinite]\nthreshold = 1\n", ["[nonfinite]", "'threshold'", "no settings"]),
    ("too_large = 0.2\n", ["'too_large'", "outside any table", "[update_ratio]"]),
    ("[update_ratio\ntoo_large = 0.2\n", ["not valid TOML", "line 1"]),
])
def test_bad_file_names_file_table_and_key(tmp_path, text, needles):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert not isinstance(e.value, TraceError)
    assert "\n" not in msg and str(p) in msg
    for n in needles:
        assert n in msg, msg


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A healthy run: Adam 1e-3, update ratios ~1e-3, no update_ratio finding by default."""
    torch.manual_seed(0)
    model = mlp()
    d = tmp_path_factory.mktemp("healthy")
    train(d, model, torch.optim.Adam(model.parameters(), 1e-3), 60, teacher_data())
    return d


def kinds(json_path):
    return [f["kind"] for f in json.loads(json_path.read_text())["findings"]]


def test_cli_config_changes_a_threshold_and_so_the_outcome(run_dir, tmp_path):
    out = tmp_path / "default.json"
    r = invoke_cli("analyze", run_dir, "--json", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    assert "update_ratio" not in kinds(out)

    cfg = write(tmp_path, "[update_ratio]\ntoo_large = 1e-4  # healthy ratios are ~1e-3\n")
    out = tmp_path / "strict.json"
    r = invoke_cli("analyze", run_dir, "--config", cfg, "--json", out, block_torch=True)
    assert r.returncode == 0, r.stderr
    assert "update_ratio" in kinds(out) and "update_ratio" in r.stdout


@pytest.mark.parametrize("text, needle", [
    ("[update_ratio]\ntoo_larg = 0.2\n", "has no setting 'too_larg'"),
    ("[memory]\nx = 1\n", "unknown table [memory]"),
    ("[update_ratio]\ntoo_large = [1]\n", "must be a number"),
])
def test_cli_bad_config_is_one_line_and_exit_2(run_dir, tmp_path, text, needle):
    cfg = write(tmp_path, text)
    r = invoke_cli("analyze", run_dir, "--config", cfg)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert str(cfg) in lines[0] and needle in lines[0], lines[0]


def test_cli_without_tomllib_says_python_3_11(run_dir, tmp_path, monkeypatch):
    # As on Python 3.10 without tomli: both imports fail (config_file imports them when a
    # config is read, so hiding them for the call is enough).
    cfg = write(tmp_path, "[update_ratio]\ntoo_large = 0.2\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    r = invoke_cli("analyze", run_dir, "--config", cfg)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "needs Python 3.11" in lines[0], r.stderr
