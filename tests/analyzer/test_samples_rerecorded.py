"""The sample cases, recorded again by this recorder, are all still found as their ground truth
says: a change to what or how often the recorder samples must not cost a detection.

sample_traces/ ships traces recorded by an earlier recorder; this test makes the cases afresh
(sample_traces/make_samples.py, seeded) and scores the analyzer on them
(sample_traces/score_analyzer.py), both as a user runs them: every finding kind but the DDP
jobs' two (healthy included), each by one case at least. Not the two DDP jobs (4 ranks under
torchrun, one ended by gloo's timeout: 30 s of the suite's 10 minutes): the same failures are
recorded under torchrun and found by tests/integrations/test_torchrun_ranks.py. Not the four
slowest single-process cases either (together half of the ~150 CPU-s the 19 cost, measured
2026-11-29), each the second case of its kind here and its mechanism recorded with the default
sampling and found by a test of its own:
  leak_hook_gru (a forward hook keeping outputs): test_pathology_definitions.py
      ::test_a_leak_names_the_module_whose_outputs_are_kept_by_the_op_that_made_them;
  attention_entropy_lr (entropy collapse inside nn.TransformerEncoderLayer, dated):
      test_activity_attention_memory.py::test_attention_entropy_collapse_is_found_in_the_layer_that_collapsed;
  dead_relu_cnn_init (F.relu in forward, dead from initialisation):
      test_activity_attention_memory.py::test_dead_from_the_start_with_functional_relu;
  healthy_gru (a quiet recurrent net): rnn_healthy_lstm_clip_adam in test_corpus_subset.py.
Nor four more (25 of the 15's ~67 CPU-s, measured 2026-11-29), each again the second of its kind
here (healthy_mlp and healthy_plateau stay quiet, vanishing_sigmoid and nan_birth are found):
  healthy_cnn_bn (a quiet CNN with BatchNorm, Adam): test_healthy_vision_families.py
      ::test_a_healthy_modern_vision_model_has_no_warning[mobilenetv2] (BatchNorm after every
      conv, AdamW);
  healthy_transformer (a quiet nn.TransformerEncoder, Adam, attention recorded):
      test_activity_attention_memory.py::test_healthy_transformer_attention_is_quiet (its attention
      captured inside nn.TransformerEncoderLayer), and over 100 steps transformers' GPT-2 and BERT in
      test_huggingface_models.py::test_a_healthy_trainer_run_is_clean;
  vanishing_cnn_sigmoid (sigmoid derivatives compounding over depth, from step 0, the first layer
      named): vanishing_sigmoid here, the same mechanism in a 12-layer MLP;
  nan_cnn_std (a bad record made NaN by a weightless module, step 45, one the recorder replays):
      nan_birth here (log of -1 in features.log, on watched step 60), and on a replayed step with
      the default activations_every test_nan_origin_inf.py
      ::test_a_nan_made_by_a_weightless_module_is_born_there[replayed].
`python sample_traces/make_samples.py` still makes all of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOUND = ("ok", "hit", "hit (step within resolution)")
sys.path.insert(0, os.path.join(ROOT, "sample_traces"))
from make_samples import CASES  # noqa: E402

# exploding_cnn left out for now: on this machine, since a system package update on 2026-11-28
# (apt, glibc's triggers), its chaotic trajectory recovers instead of overflowing (100x at step
# 41, the loss spikes to 312 and comes back; the same with the recorder of the day before), so
# make_samples.py refuses it; the shipped trace still holds the overflow (see the issue note).
COVERED_ELSEWHERE = ("leak_hook_gru", "attention_entropy_lr", "dead_relu_cnn_init", "healthy_gru",
                     "healthy_cnn_bn", "healthy_transformer", "vanishing_cnn_sigmoid", "nan_cnn_std")
SINGLE_PROCESS = [c for c in CASES if not c.startswith("ddp_") and c not in ("exploding_cnn", *COVERED_ELSEWHERE)]


def test_every_sample_case_recorded_now_is_found(tmp_path):
    out = tmp_path / "samples"
    made = subprocess.run([sys.executable, os.path.join(ROOT, "sample_traces", "make_samples.py"),
                           "--out", str(out), "--jobs", "2", *SINGLE_PROCESS], capture_output=True, text=True,
                          timeout=900)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    scores = tmp_path / "scores.json"
    scored = subprocess.run([sys.executable, os.path.join(ROOT, "sample_traces", "score_analyzer.py"),
                             "--samples", str(out), "--json", str(scores)], capture_output=True, text=True,
                            timeout=600)
    assert scored.returncode == 0, scored.stderr[-3000:]
    rows = json.loads(scores.read_text())
    assert len(rows) == len(SINGLE_PROCESS) == 11, [r["case"] for r in rows]
    # No kind left to other tests alone: every one the shipped single-process cases hold is re-recorded.
    with open(os.path.join(ROOT, "sample_traces", "expected.json")) as f:
        shipped = {c: e["kind"] for c, e in json.load(f).items() if not c.startswith("ddp_")}
    assert {r["expected"]["kind"] for r in rows} == set(shipped.values())
    missed = [(r["case"], r["verdict"]) for r in rows if r["verdict"] not in FOUND]
    assert not missed, scored.stdout
