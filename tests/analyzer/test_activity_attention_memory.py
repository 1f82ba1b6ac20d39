"""dead_relu, attention_collapse and memory_leak on small real runs made in the test."""

import time

import torch
import torch.nn.functional as F
from torch import nn

from tests import training
from torchautopsy import Recorder, load
from torchautopsy.analyzer.run import analyze


class FunctionalMLP(nn.Module):
    """ReLU called with F.relu inside forward (no nn.ReLU module), or LeakyReLU/GELU."""

    def __init__(self, act="relu", dead_bias=None):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)
        self.act = act
        if dead_bias is not None:
            with torch.no_grad():
                self.fc1.bias.fill_(dead_bias)

    def forward(self, x):
        h = self.fc1(x)
        if self.act == "relu":
            h = F.relu(h)
        elif self.act == "leaky":
            h = F.leaky_relu(h, 0.02)
        else:
            h = F.gelu(h)
        return self.out(F.relu(self.fc2(h)))


def _inputs_as_targets(shape):
    """Batches of random inputs from a generator seeded 0, each its own target (the loss reads
    the part of it it learns)."""
    g = torch.Generator().manual_seed(0)

    def batch(step):
        x = torch.randn(*shape, generator=g)
        return x, x

    return batch


def _each_step(model, each_step):
    return (lambda step, loss: each_step(step, model)) if each_step else None


def train(run_dir, model, steps=100, lr=0.01, each_step=None, batch=32):
    training.train(model, run_dir, steps, _inputs_as_targets((batch, 8)),
                   lambda out, x: (out - x[:, :1]).pow(2).mean(),
                   optimizer=torch.optim.SGD(model.parameters(), lr=lr), after_update=_each_step(model, each_step))
    return analyze(load(run_dir))


def of_kind(findings, kind):
    return [f for f in findings if f.kind == kind]


def test_dead_from_the_start_with_functional_relu(tmp_path):
    torch.manual_seed(0)
    findings = train(tmp_path, FunctionalMLP("relu", dead_bias=-50.0))
    (f,) = [f for f in of_kind(findings, "dead_relu") if f.evidence["units"] == 32
            and f.evidence["dead_share"] == 1.0]
    assert f.severity == "error" and f.where == [""]  # F.relu in the model's own forward
    assert f.evidence["dead_since_start"] == 32 and f.evidence["died_during_training"] == 0
    assert f.step == 0 and "(its first F.relu call of 2 in a step)" in f.summary


def test_leaky_relu_units_stuck_negative_note_the_slope(tmp_path):
    torch.manual_seed(0)
    findings = train(tmp_path, FunctionalMLP("leaky", dead_bias=-50.0), lr=1e-4)
    (f,) = [f for f in of_kind(findings, "dead_relu") if f.evidence["activation"] == "LeakyReLU"]
    assert f.severity == "warning" and f.evidence["negative_slope"] == 0.02
    assert "0.02" in f.summary


def test_healthy_gelu_and_relu_nets_have_no_dead_layers(tmp_path):
    for i, act in enumerate(("relu", "gelu")):
        torch.manual_seed(0)
        findings = train(tmp_path / act, FunctionalMLP(act))
        assert of_kind(findings, "dead_relu") == [], [f.summary for f in findings]


def test_units_that_die_during_training_are_dated(tmp_path):
    # At step 60 a huge negative bias update kills every unit of fc1 (as a bad LR spike would).
    def kill(step, model):
        if step == 60:
            with torch.no_grad():
                model.fc1.bias.fill_(-50.0)

    torch.manual_seed(0)
    findings = train(tmp_path, FunctionalMLP("relu"), steps=150, each_step=kill)
    (f,) = [f for f in of_kind(findings, "dead_relu") if f.evidence["dead_share"] == 1.0]
    assert f.evidence["died_during_training"] > 0
    assert 50 <= f.evidence["first_death_step"] <= 100  # the window after their last activity


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.layer(x)).mean(1)


def train_transformer(run_dir, steps, each_step=None):
    torch.manual_seed(0)
    model = TinyTransformer()
    training.train(model, run_dir, steps, _inputs_as_targets((8, 12, 16)),
                   lambda out, x: (out - x[:, 0, :1]).pow(2).mean(),
                   optimizer=torch.optim.Adam(model.parameters(), 1e-3), after_update=_each_step(model, each_step))
    return load(run_dir)


def test_attention_entropy_collapse_is_found_in_the_layer_that_collapsed(tmp_path):
    # From step 40 the query/key projections grow by 30% a step (attention logits blowing up,
    # as with a too-high learning rate): softmax rows go one-hot.
    def grow(step, model):
        if step >= 40:
            with torch.no_grad():
                model.layer.self_attn.in_proj_weight[:32].mul_(1.3)

    found = of_kind(analyze(train_transformer(tmp_path, 100, grow)), "attention_collapse")
    entropy = [f for f in found if f.evidence["collapse"] == "entropy"]
    assert entropy, [f.summary for f in found]
    assert entropy[0].where == ["layer.self_attn"] and 40 <= entropy[0].step <= 80


def test_healthy_transformer_attention_is_quiet(tmp_path):
    trace = train_transformer(tmp_path, 60)
    assert len(trace.ranks[0].attention_sites) == 1  # captured inside TransformerEncoderLayer
    assert [f for f in analyze(trace) if f.severity != "info"] == []


def test_a_loss_kept_with_its_graph_is_a_leak_and_named_as_such(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    kept = []
    g = torch.Generator().manual_seed(0)
    with Recorder(model, tmp_path, census_every=10, census_budget=1.0) as rec:
        for step in range(120):
            x = torch.randn(256, 64, generator=g)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward(retain_graph=True)
            opt.step()
            kept.append(loss)  # the classic: the loss tensor, graph and saved activations kept
            rec.step(loss=loss)
    (f,) = of_kind(analyze(load(tmp_path)), "memory_leak")
    # 2 saved activations of 256x512 float32 per step: ~1 MiB
    assert 0.5 * 2**20 < f.evidence["bytes_per_step"] < 4 * 2**20, f.evidence
    assert f.evidence["live_tensors_with_graph_per_step"] >= 0.5
    assert "losses.append(loss)" in f.advice


def test_a_loss_kept_after_backward_is_a_leak_before_memory_shows_it(tmp_path):
    """losses.append(loss) without retain_graph: backward freed the activations, so each kept loss
    holds only its graph's nodes (KBs), far below what resident memory shows in a short run; the
    census still counts one more tensor with a graph per step."""
    torch.manual_seed(0)

    class SelfLoss(nn.Module):
        """Computes its own loss (as transformers' models do with labels=): its output is a scalar."""

        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, x):
            return self.net(x).pow(2).mean()

    model = SelfLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kept = []
    g = torch.Generator().manual_seed(0)

    def train(run_dir, keep):
        with Recorder(model, run_dir, census_every=10, census_budget=1.0) as rec:
            for step in range(150):
                x = torch.randn(32, 32, generator=g)
                loss = model(x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                kept.append(keep(loss))
                # A step of ~5 ms, as a real model's: a census (~50-100 ms in this process)
                # within its budget every 10-20 steps, not only every ~300 tiny ones.
                time.sleep(0.005)
                rec.step(loss=loss)

    train(tmp_path / "leak", keep=lambda loss: loss)
    (f,) = of_kind(analyze(load(tmp_path / "leak")), "memory_leak")
    assert f.evidence["series"] == "live_tensors_with_graph", f.summary
    assert 0.9 <= f.evidence["tensors_with_graph_per_step"] <= 1.1
    assert f.evidence["growing_group"]["shape"] == "[]" and f.evidence["growing_group"]["graph"], f.evidence
    assert "a loss tensor kept across iterations" in f.summary
    assert "the output of" not in f.summary  # (the model's own output is that loss: no module to blame)
    # The same loop that reads loss.item() instead of keeping the tensor: no leak.
    train(tmp_path / "ok", keep=lambda loss: loss.item())
    assert not of_kind(analyze(load(tmp_path / "ok")), "memory_leak")


class TanhNet(nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 1)
        with torch.no_grad():
            self.fc1.weight.mul_(gain)  # inputs far outside tanh's linear range when gain is large

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def test_saturated_tanh_is_found_and_a_healthy_one_is_not(tmp_path):
    torch.manual_seed(0)
    found = of_kind(train(tmp_path / "sat", TanhNet(gain=60.0), lr=1e-4), "saturation")
    assert [f.where for f in found] == [[""]] and found[0].evidence["function"] == "tanh"
    assert found[0].severity == "warning" and found[0].evidence["saturated_share"] > 0.5
    torch.manual_seed(0)
    assert of_kind(train(tmp_path / "ok", TanhNet(gain=1.0)), "saturation") == []
