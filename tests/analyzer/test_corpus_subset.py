"""A fast subset of the validation corpus (benchmarks/corpus/, scored in full by
benchmarks/score_corpus.py): real scenarios trained and recorded, their oracles proven by their
own measurements, scored by the real scorer. The subset holds cases the analyzer gets right
today whose mechanism no other test records (an attention collapse present from initialisation
included), and healthy controls: a detector change that breaks one fails here before the full
corpus is run. Not these three, each recorded the same way and found by a test of its own
(together 1/3 of the nine's ~38 CPU-s, measured 2026-11-29):
  mlp_deep_sigmoid_vanishing (a deep sigmoid MLP, default init, vanishing from step 0):
      vanishing_sigmoid in test_samples_rerecorded.py, a 12-layer one;
  mlp_log_of_relu_weightless (-Inf from a weightless log, fed to a Linear, named the log's):
      test_nan_origin_inf.py::test_a_log_of_zero_feeding_a_linear_is_born_in_the_log_not_the_linear;
  rnn_exploding_spectral_radius_init (a recurrent matrix of spectral radius 3, exploding from step
      0): test_explosion_through_time.py::test_a_recurrent_layer_exploding_through_time_is_found_from_step_0,
      and the rule that finds this tanh one (gradients growing towards the input from step 0) on
      fresh_mlp_siren_default_hidden_init_explodes here and in test_pathology_definitions.py
      ::test_gradients_growing_towards_the_input_from_step_0_are_exploding."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "rnn_nonfinite_exp_rate_overflow": "hit",
    "mlp_dead_relu_negative_bias_init": "hit",
    "transformer_attention_collapse_qk_init": "hit",  # one-hot from initialisation
    "fresh_mlp_siren_default_hidden_init_explodes": "hit",  # from step 0, across depth (fresh: never tuned on)
    "mlp_healthy_dropout_wd_clip": "quiet",
    "rnn_healthy_lstm_clip_adam": "quiet",
}


def test_a_fast_subset_of_the_corpus_scores_as_it_should():
    out = Path(tempfile.mkdtemp(prefix="corpus_"))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "score_corpus.py"), "--out", str(out),
                        "--jobs", "1", "--json", str(out / "verdicts.json"), *EXPECTED],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {row["name"]: row for row in json.loads((out / "verdicts.json").read_text())}
    assert {n: rows[n]["verdict"] for n in EXPECTED} == EXPECTED, r.stdout[-3000:]
    for name in EXPECTED:  # every oracle was proven and written by the scenario itself
        oracle = json.loads((out / name / "oracle.json").read_text())
        assert oracle["source"] and oracle["split"] in ("tune", "holdout", "fresh")
