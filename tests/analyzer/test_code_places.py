"""Where to look (issue 27): a finding that names a module says where that module's code is, from
the sources the recorder read at start-up -- a job's own module by its class and forward, a
module of torch's own (nn.Linear) by the module of other code that calls it. The job runs as a
real one does: a script beside its package of models, in a process of its own (forked from an
interpreter that imported torch: tests/forked_jobs.py; sys.path[0] the script's folder)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import invoke_cli

FEATURES = '''\
import torch
from torch import nn


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.weight


class LogFeatures(nn.Module):
    """log(x), fine while the inputs stay positive."""

    def forward(self, x):
        return torch.log(x)
'''

TRAIN = '''\
import sys
import torch
from torch import nn
from models.features import LogFeatures, Scale
from torchautopsy import Recorder

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Softplus(), Scale(), LogFeatures(), nn.Linear(8, 1))
features = model[3]
opt = torch.optim.SGD(model.parameters(), lr=0.01)
rec = Recorder(model, sys.argv[1], activations_every=1)
for step in range(8):
    x = torch.randn(16, 8)
    if step == 5:
        x = x * 0 - 1e4  # softplus(-1e4 * w + b) underflows to 0: log(0) = -inf
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    rec.step(loss=loss)
rec.close()
'''


def _line_of(text: str, start: str) -> int:
    return next(i + 1 for i, line in enumerate(text.splitlines()) if line.lstrip().startswith(start))


@pytest.mark.slow  # a training script and the CLI without torch, subprocesses
def test_a_nan_born_in_a_modules_forward_names_that_forward_and_its_class(jobs, tmp_path: Path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "features.py").write_text(FEATURES)
    (tmp_path / "train.py").write_text(TRAIN)
    r = jobs.run([sys.executable, "train.py", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

    out = tmp_path / "f.json"
    cli = invoke_cli("analyze", tmp_path / "run", "--json", out, block_torch=True)
    assert cli.returncode == 0, cli.stderr
    findings = json.loads(out.read_text())["findings"]
    bad = [f for f in findings if f["kind"] == "nonfinite"][0]
    assert bad["where"][0] == "3", bad
    cls = _line_of(FEATURES, "class LogFeatures")
    fwd = cls + 3  # (its forward: after the class line and its docstring)
    assert bad["evidence"]["code"]["3"] == \
        f"LogFeatures.forward, models/features.py:{fwd} (class at models/features.py:{cls})", bad["evidence"]


@pytest.mark.slow  # transformers
def test_a_torch_module_is_placed_in_the_transformers_code_that_calls_it(tmp_path: Path):
    """nn.Linear's own file is not where anyone looks: the forward of the BERT module that calls it is."""
    import inspect

    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.models.bert import modeling_bert

    from torchautopsy import Recorder, load
    from torchautopsy.analyzer.code_places import with_code
    from torchautopsy.analyzer.findings import Finding

    model = BertForSequenceClassification(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                     intermediate_size=64, vocab_size=100))
    with Recorder(model, tmp_path / "run") as rec:
        out = model(input_ids=torch.randint(0, 100, (2, 8)), labels=torch.tensor([0, 1]))
        out.loss.backward()
        rec.step(loss=out.loss)
    rt = load(tmp_path / "run").ranks[0]
    query = "bert.encoder.layer.0.attention.self.query"
    f = with_code(Finding("exploding_gradients", "warning", 0, [query, f"{query}.weight", "classifier"],
                          "s", {}, "a"), rt)
    cls = modeling_bert.BertSelfAttention
    path = "transformers/models/bert/modeling_bert.py"
    fwd = inspect.unwrap(cls.forward).__code__.co_firstlineno
    line = _class_line(cls)
    expected = f"Linear in bert.encoder.layer.0.attention.self: BertSelfAttention.forward, {path}:{fwd} " \
               f"(class at {path}:{line})"
    assert f.evidence["code"][query] == expected
    assert f.evidence["code"][f"{query}.weight"] == expected  # (a parameter: its module's)
    head = modeling_bert.BertForSequenceClassification
    assert f.evidence["code"]["classifier"].startswith(
        f"Linear in the model: BertForSequenceClassification.forward, {path}:"
        f"{inspect.unwrap(head.forward).__code__.co_firstlineno} (class at {path}:{_class_line(head)})")


def _class_line(cls) -> int:
    """The line of the `class` statement (inspect's starts at its decorators)."""
    import inspect

    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, text in enumerate(lines) if text.lstrip().startswith("class "))
