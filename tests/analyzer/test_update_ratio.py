"""update_ratio on real recorded runs: updates far too large, weights that do not move, and the
weights it must not judge (biases, frozen weights, zero-initialised weights)."""

import numpy as np
import torch

from tests.analyzer.training_runs import class_data, mlp, teacher_data, train
from torchautopsy.analyzer.config import AnalysisConfig, UpdateRatioConfig
from torchautopsy.analyzer.run import analyze

WEIGHTS = ["0.weight", "2.weight", "4.weight"]


def update_findings(trace, cfg=None):
    return [f for f in analyze(trace, cfg) if f.kind == "update_ratio"]


def test_adamw_lr_1_moves_every_weight_by_a_tenth_per_step(tmp_path):
    # AdamW with lr 1 (1000x the usual) and weight decay 0.5: every element moves by ~1 per step
    # while decay keeps the weights bounded, so the loss stays finite and the ratio stays > 0.1.
    torch.manual_seed(0)
    model = mlp(d_out=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.5)
    trace = train(tmp_path, model, opt, 100, class_data())
    assert np.isfinite(trace.ranks[0].steps["loss"].to_numpy()).all()
    (f,) = update_findings(trace)
    assert f.severity == "warning" and f.evidence["direction"] == "too_large"
    assert sorted(f.where) == WEIGHTS  # biases are never judged
    assert f.step == 0  # large from the first sampled update on
    assert all(r > 0.1 for r in f.evidence["median_ratio_by_parameter"].values())
    assert "learning rate" in f.advice


def test_lr_1e_minus_9_leaves_the_weights_where_they_were(tmp_path):
    torch.manual_seed(0)
    model = mlp()
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 1e-9), 40, teacher_data())
    (f,) = update_findings(trace)
    assert f.severity == "warning" and f.evidence["direction"] == "too_small"
    assert sorted(f.where) == WEIGHTS and f.step == 0
    assert all(g > 0 for g in f.evidence["median_grad_norm_by_parameter"].values())


def test_weight_left_out_of_the_optimizer_is_named_but_a_frozen_one_is_not(tmp_path):
    torch.manual_seed(0)
    model = mlp()
    model[0].requires_grad_(False)  # frozen on purpose: no gradient, not judged
    trained = [p for n, p in model.named_parameters() if p.requires_grad and n != "2.weight"]
    trace = train(tmp_path, model, torch.optim.Adam(trained, 1e-3), 40, teacher_data())
    (f,) = update_findings(trace)
    assert f.where == ["2.weight"] and f.evidence["direction"] == "too_small", f.summary
    assert f.evidence["median_ratio_by_parameter"] == {"2.weight": 0.0}
    assert "in the optimizer" in f.advice


def test_zero_initialised_weight_is_not_judged(tmp_path):
    # A zero-initialised output layer (as LoRA's B, or zero-init residual projections): its
    # ratio is relative to ~0 (Inf at first), which says nothing about the learning rate.
    torch.manual_seed(0)
    model = mlp()
    torch.nn.init.zeros_(model[4].weight)
    trace = train(tmp_path, model, torch.optim.Adam(model.parameters(), 1e-2), 40, teacher_data())
    ratio = trace.ranks[0].update_ratio()["4.weight"].to_numpy()
    assert np.isinf(ratio[0]) and np.median(ratio[1:]) > 0.02  # what is being skipped
    assert update_findings(trace) == []
    # Judged like the others (min_weight_rms 0) it would be flagged at a threshold of 0.02 ...
    judged = AnalysisConfig(update_ratio=UpdateRatioConfig(too_large=0.02, min_weight_rms=0.0))
    assert "4.weight" in update_findings(trace, judged)[0].where
    # ... while by default it is skipped, whatever the threshold.
    skipped = AnalysisConfig(update_ratio=UpdateRatioConfig(too_large=0.02))
    assert all("4.weight" not in f.where for f in update_findings(trace, skipped))


def test_healthy_adam_and_sgd_runs_are_quiet_unless_the_threshold_says_otherwise(tmp_path):
    for i, opt in enumerate([lambda p: torch.optim.Adam(p, 1e-3), lambda p: torch.optim.SGD(p, 0.05)]):
        torch.manual_seed(0)
        model = mlp()
        trace = train(tmp_path / str(i), model, opt(model.parameters()), 60, teacher_data())
        assert update_findings(trace) == []
        # Ratios of ~1e-3 are what a tightened threshold of 1e-4 reports as too large.
        strict = AnalysisConfig(update_ratio=UpdateRatioConfig(too_large=1e-4))
        (f,) = update_findings(trace, strict)
        assert f.evidence["direction"] == "too_large" and set(f.where) <= set(WEIGHTS)


def test_too_few_samples_give_no_verdict(tmp_path):
    torch.manual_seed(0)
    model = mlp()
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 1e-9), 20, teacher_data())
    assert len(trace.ranks[0].update_ratio()) == 2  # steps 0 and 10
    assert update_findings(trace) == []


def test_weights_whose_gradient_is_exactly_zero_are_left_to_the_gradient_detectors(tmp_path):
    # A final ReLU that is off for every input: every gradient is 0, so nothing moves; that is
    # vanishing_gradients' finding, not a learning-rate or optimizer problem.
    torch.manual_seed(0)
    model = mlp()
    model.append(torch.nn.ReLU())
    with torch.no_grad():
        model[-2].bias.fill_(-100.0)
    trace = train(tmp_path, model, torch.optim.SGD(model.parameters(), 0.01), 40, teacher_data())
    assert (trace.ranks[0].update_ratio()[WEIGHTS].to_numpy() == 0).all()
    assert update_findings(trace) == []
