"""loss_plateau on real recorded runs: a model at the limit of its capacity plateaus (info only);
a loss still falling, a run with zero gradients and a short run do not."""

import torch
from torch import nn

from tests.analyzer.training_runs import mlp, teacher_data, train
from torchautopsy.analyzer.config import AnalysisConfig, LossPlateauConfig
from torchautopsy.analyzer.run import analyze


def plateaus(findings):
    return [f for f in findings if f.kind == "loss_plateau"]


def test_model_at_its_limit_plateaus_as_info(tmp_path):
    # A linear model fits the teacher's linear part within ~40 steps, then sits at the noise floor.
    torch.manual_seed(1)
    model = nn.Linear(8, 1)
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.05), 150,
                  teacher_data(seed=1, n=256))
    (f,) = plateaus(analyze(trace))
    assert f.severity == "info" and f.where == []
    assert 20 <= f.step <= 75, f.summary
    ev = f.evidence
    assert abs(ev["relative_improvement"]) < 0.05
    assert ev["median_total_grad_norm"] > 0
    assert ev["start_loss"] > 3 * ev["loss_level"]  # it did learn before it stopped
    assert ev["steps_on_plateau"] == 150 - f.step
    assert "learning rate" in f.advice and "capacity" in f.advice


def test_loss_still_falling_is_no_plateau(tmp_path):
    # The same model with a small learning rate: the loss still falls steadily at the end.
    torch.manual_seed(1)
    model = nn.Linear(8, 1)
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.002), 150,
                  teacher_data(seed=1, n=256))
    loss = trace.ranks[0].steps["loss"].to_numpy()
    assert loss[-10:].mean() < 0.8 * loss[75:85].mean()
    assert plateaus(analyze(trace)) == []
    # With a threshold above the improvement it makes, the same run counts as a plateau.
    lenient = AnalysisConfig(loss_plateau=LossPlateauConfig(min_improvement=0.9))
    assert len(plateaus(analyze(trace, lenient))) == 1


def test_zero_gradients_are_not_called_a_plateau(tmp_path):
    # The output passes through a ReLU that is off for every input: nothing learns, the loss is
    # flat; vanishing_gradients says so, a plateau would only repeat it with the wrong advice.
    torch.manual_seed(0)
    model = mlp()
    model.append(nn.ReLU())
    with torch.no_grad():
        model[-2].bias.fill_(-100.0)
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.01), 110, teacher_data())
    findings = analyze(trace)
    assert plateaus(findings) == []
    assert [f.kind for f in findings if f.kind == "vanishing_gradients"] == ["vanishing_gradients"]


def test_short_run_is_not_judged(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.0), 60, teacher_data())
    assert plateaus(analyze(trace)) == []  # flat, but 30 steps of tail is no long stretch
