"""diff: pairs of real recorded runs (a small MLP regression, and transformers' GPT-2) compared
by diff_runs: identical twins, a setup change, a layer initialised larger, inputs rescaled
mid-run, an lr spike, other seeds (the same within noise), runs of other lengths."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.training import squared_error, train
from torchautopsy import Recorder, load
from torchautopsy.analyzer.diff import diff_runs


def _mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def _batches(seed, scale_from=None):
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(99))  # the task: the same in every run

    def batch(step):
        g = torch.Generator().manual_seed(seed * 100_000 + step)
        x = torch.randn(32, 16, generator=g)
        y = x @ w + 0.1 * torch.randn(32, 1, generator=g)
        if scale_from is not None and step >= scale_from:
            x = x * 10  # a pipeline change: raw units from here on
        return x, y

    return batch


def _run(path, seed=0, steps=80, lr=0.01, init=None, scale_from=None, lr_at=None):
    torch.manual_seed(seed)
    model = _mlp()
    if init is not None:
        init(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    train(model, str(path), steps, _batches(seed, scale_from), squared_error, optimizer=opt, lr_at=lr_at)
    return load(str(path))


def _restarted(path, steps=80, checkpoint=30, died_at=50, scale_from=None):
    """The reference recipe restarted: attempt 1 checkpoints before step 30, goes wrong from step
    35 (its inputs rescaled) and stops after step 49; attempt 2 resumes from the checkpoint at
    step 30 into the same run directory and runs to the end (``scale_from``: its inputs rescaled
    from that step)."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def attempt(first, last, batch, **options):
        with Recorder(model, str(path), **options) as rec:
            for step in range(first, last):
                if step == checkpoint:
                    saved.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
                x, y = batch(step)
                loss = squared_error(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.step(loss=loss)

    saved = []
    attempt(0, died_at, _batches(0, scale_from=35))
    model.load_state_dict(saved[0][0])
    opt.load_state_dict(saved[0][1])
    attempt(checkpoint, steps, _batches(0, scale_from), start_step=checkpoint)
    return load(str(path))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("a"))


def test_two_seeded_runs_are_identical(reference, tmp_path):
    d = diff_runs(reference, _run(tmp_path))
    assert d.identical and d.parted is None, d.verdict()
    assert d.to_dict() == {"identical": True, "parted": None, "setup": [], "new_findings": {"a": [], "b": []}}


def test_an_lr_doubled_is_a_setup_difference_and_parts_at_once(reference, tmp_path):
    d = diff_runs(reference, _run(tmp_path, lr=0.02))
    assert {"name": "lr", "a": 0.01, "b": 0.02} in d.setup, d.setup
    assert d.parted is not None and d.parted.step == 0 and d.parted.what == "learning rate", d.verdict()
    assert d.verdict().endswith("; setup: lr 0.01 → 0.02."), d.verdict()  # the cause, in the verdict


def test_a_layer_initialised_3x_larger_is_named_at_step_0(reference, tmp_path):
    def bigger(model):
        with torch.no_grad():
            model[2].weight.mul_(3)

    d = diff_runs(reference, _run(tmp_path, init=bigger))
    assert d.parted.step == 0 and d.parted.where == ["2"], d.verdict()
    assert 2.0 < d.parted.ratio < 4.5, d.parted
    assert d.to_dict()["parted"]["where"] == ["2"]
    # The report's per-module picture: at the first watched steps, layer 2's output is the first
    # to stand out (~3x); the layers before it are A's.
    from torchautopsy.reports.diff_figures import _heat

    x, names, ratio = _heat(d, "modules/output_absmax")
    first = dict(zip(names, ratio[0]))
    assert abs(first["0"]) < 0.01 and abs(first["1"]) < 0.01 and 0.3 < first["2"] < 0.65, first


def test_inputs_scaled_10x_part_in_the_batch_before_any_module(reference, tmp_path):
    d = diff_runs(reference, _run(tmp_path, scale_from=30))
    assert d.parted.step == 30 and d.parted.stage == "batch" and d.parted.where == [], d.verdict()
    assert 9 < d.parted.ratio < 11


def test_an_lr_spike_at_60_parts_at_60_in_the_lr(reference, tmp_path):
    d = diff_runs(reference, _run(tmp_path, lr_at=lambda s: 0.5 if s in (60, 61) else 0.01))
    assert d.parted.step == 60 and d.parted.what == "learning rate", d.verdict()
    assert d.loss_parted is not None and d.loss_parted.step == 61  # the loss follows a step later
    assert "1 step(s) before its loss" in d.verdict()


def test_other_seeds_are_the_same_within_noise(reference, tmp_path):
    for seed in (1, 2):
        d = diff_runs(reference, _run(tmp_path / str(seed), seed=seed))
        assert not d.identical and d.parted is None, d.verdict()
        assert "within their noise" in d.verdict()


def test_runs_of_other_lengths_align_by_step(reference, tmp_path):
    d = diff_runs(reference, _run(tmp_path, steps=50))
    assert d.identical and d.common_steps == 50
    # A longer than B, changed only after B's last step: identical over the 80 steps they share.
    d = diff_runs(_run(tmp_path / "long", steps=120, scale_from=100), reference)
    assert d.identical and d.common_steps == 80, d.verdict()


def test_a_restarted_run_aligns_by_step_over_its_timeline(reference, tmp_path):
    """B's attempt 1 ran steps 30-49 (wrong from 35) that its attempt 2 ran again from the
    checkpoint: the timeline (attempt 2's steps from 30) matches A's to the bit; a change in
    attempt 2 is dated."""
    b = _restarted(tmp_path / "same")
    assert [len(v) for v in b.attempts.values()] == [2]
    d = diff_runs(reference, b)
    assert d.identical and d.common_steps == 80, d.verdict()
    d = diff_runs(reference, _restarted(tmp_path / "scaled", scale_from=60))
    assert d.parted.step == 60 and d.parted.stage == "batch", d.verdict()


def _gpt2(path, seed: int, merge_at=None):
    """transformers' GPT-2 (2 layers), AdamW with warm-up, its own seed for init and data;
    ``merge_at``: from that step block 1's MLP input weights are 4x (a bad checkpoint merge)."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)

    def before(step):
        if step == merge_at:
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.weight.mul_(4)

    def batch(step):
        ids = torch.randint(0, 64, (8, 32), generator=g)
        return ids.sort(dim=1).values  # a learnable task: sorted tokens

    train(model, str(path), 80, batch, lambda out: out.logits[:, :-1].flatten(0, 1).log_softmax(-1).mean().neg(),
          optimizer=opt, before_step=before, lr_at=lambda s: 1e-3 * min(1.0, (s + 1) / 10))
    return load(str(path))


def test_gpt2_seeds_are_the_same_and_a_bad_merge_parts_where_it_happened(tmp_path):
    a = _gpt2(tmp_path / "a", seed=0)
    d = diff_runs(a, _gpt2(tmp_path / "b", seed=1))
    assert d.parted is None and not d.identical, d.verdict()
    d = diff_runs(a, _gpt2(tmp_path / "c", seed=1, merge_at=40))
    assert d.parted is not None and 40 <= d.parted.step <= 42, d.verdict()
    assert d.parted.where and d.parted.where[0].startswith("transformer.h.1.mlp"), d.verdict()
