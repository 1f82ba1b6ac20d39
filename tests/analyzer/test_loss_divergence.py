"""loss_divergence on real recorded runs: blow-ups, a loss that rises and stays up, and the runs
that must stay quiet (healthy, a recovered bad shard, a NaN that is nonfinite's business)."""

import json

import numpy as np
import torch
from torch import nn

from tests.analyzer.training_runs import mlp, teacher_data, train
from torchautopsy.analyzer.config import AnalysisConfig, LossDivergenceConfig
from torchautopsy.analyzer.run import analyze

OURS = ("loss_divergence", "loss_plateau", "update_ratio")


def of_kind(findings, kind):
    return [f for f in findings if f.kind == kind]


def test_lr_far_too_high_blows_the_loss_up_to_inf(tmp_path):
    # Linear regression: SGD is stable below lr 1 here; at step 50 the lr jumps to 3, and every
    # step multiplies the error by ~5 until the loss overflows.
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.05), 100, teacher_data(),
                  lr_at=lambda s: 0.05 if s < 50 else 3.0)
    (f,) = of_kind(analyze(trace), "loss_divergence")
    assert f.severity == "error" and f.where == [], f.summary
    # Step 50's update is the first with lr 3; the loss of step 51 is the first to show it.
    assert 51 <= f.step <= 53, f.summary
    ev = f.evidence
    assert ev["first_nonfinite_loss_step"] > f.step
    assert ev["best_step"] < 51 and ev["ratio_to_best"] >= 2
    assert "went Inf" in f.summary and f.advice
    json.dumps(f.to_dict(), allow_nan=False)


def test_loss_that_rises_and_stays_up_is_a_warning(tmp_path):
    # An MLP trained well for 50 steps, then lr 1.0: its ReLUs die, the loss jumps ~80x and stays.
    torch.manual_seed(0)
    model = mlp()
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.05), 100, teacher_data(),
                  lr_at=lambda s: 0.05 if s < 50 else 1.0)
    (f,) = of_kind(analyze(trace), "loss_divergence")
    assert f.severity == "warning", f.summary
    assert 51 <= f.step <= 55, f.summary
    assert f.evidence["first_nonfinite_loss_step"] is None
    assert f.evidence["final_smoothed_loss"] > 10 * f.evidence["best_smoothed_loss"]
    assert "stayed up" in f.summary
    # The same run judged with a rise threshold above what happened: no finding.
    quiet = AnalysisConfig(loss_divergence=LossDivergenceConfig(rise_ratio=1000.0))
    assert of_kind(analyze(trace, quiet), "loss_divergence") == []


def test_sample_exploding_lr_diverges_before_the_gradients_explode():
    from tests.helpers import SAMPLES
    from torchautopsy import load

    findings = analyze(load(SAMPLES / "exploding_lr"))
    (f,) = of_kind(findings, "loss_divergence")
    (g,) = of_kind(findings, "exploding_gradients")
    assert f.severity == "error" and f.step <= g.step
    assert f.evidence["first_nonfinite_loss_step"] == 48


def test_a_bad_shard_the_run_recovers_from_is_not_a_divergence(tmp_path):
    # Steps 60-74 read targets scaled 10x (a corrupt shard): the loss jumps ~300x, then recovers.
    torch.manual_seed(0)
    model = mlp()
    data = teacher_data(target_scale=lambda s: 10.0 if 60 <= s < 75 else 1.0)
    trace = train(tmp_path, model, torch.optim.Adam(model.parameters(), 1e-3), 160, data)
    loss = trace.ranks[0].steps["loss"].to_numpy()
    assert loss[60:75].min() > 50 * loss[40:60].max()  # the spike is there
    assert of_kind(analyze(trace), "loss_divergence") == []


def test_a_nan_out_of_the_blue_is_left_to_nonfinite(tmp_path):
    class Log(nn.Module):  # log of the features; one batch holds a negative value at step 40
        def forward(self, x):
            return torch.log(x)

    torch.manual_seed(0)
    model = nn.Sequential(Log(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(3)

    def data(step):
        x = torch.rand(32, 8, generator=g) + 0.5
        if step == 40:
            x[3, 2] = -1.0
        return x, x.sum(1, keepdim=True), nn.functional.mse_loss

    findings = analyze(train(tmp_path, model, torch.optim.Adam(model.parameters(), 1e-3), 60, data))
    assert [f.step for f in of_kind(findings, "nonfinite")] == [40]
    assert of_kind(findings, "loss_divergence") == []


def test_healthy_runs_give_none_of_our_warnings(tmp_path):
    for i, make_opt in enumerate([lambda p: torch.optim.Adam(p, 1e-3),
                                  lambda p: torch.optim.SGD(p, 0.05, momentum=0.9)]):
        torch.manual_seed(0)
        model = mlp()
        trace = train(tmp_path / str(i), model, make_opt(model.parameters()), 100, teacher_data())
        serious = [f for f in analyze(trace) if f.kind in OURS and f.severity != "info"]
        assert serious == [], [f.summary for f in serious]


def test_no_loss_given_says_how_to_record_it(tmp_path):
    torch.manual_seed(0)
    model = mlp()
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.01), 30, teacher_data(),
                  pass_loss=False)
    found = [f for f in analyze(trace) if f.kind in ("loss_divergence", "loss_plateau")]
    assert sorted(f.kind for f in found) == ["loss_divergence", "loss_plateau"]
    assert all(f.severity == "info" and "rec.step(loss=loss)" in f.advice for f in found)


def test_loss_passed_on_some_steps_only_is_not_taken_for_a_nan_loss(tmp_path):
    # rec.step(loss=loss) every other step, rec.step() in between: the trace holds NaN there,
    # with finite gradients, which is no NaN loss; the losses given still show the divergence.
    torch.manual_seed(0)
    model = mlp()
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.05), 100, teacher_data(),
                  lr_at=lambda s: 0.05 if s < 50 else 1.0, pass_loss=lambda s: s % 2 == 0)
    assert np.isnan(trace.ranks[0].steps["loss"].to_numpy()[1::2]).all()
    (f,) = of_kind(analyze(trace), "loss_divergence")
    assert f.severity == "warning" and f.evidence["first_nonfinite_loss_step"] is None
    assert 50 <= f.step <= 56 and f.step % 2 == 0, f.summary


def test_a_run_shorter_than_the_window_is_not_judged(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 5.0), 15, teacher_data())
    assert of_kind(analyze(trace), "loss_divergence") == []
