"""A fast subset of the validation corpus (benchmarks/corpus/, scored in full by
benchmarks/score_corpus.py): real scenarios trained and recorded, their oracles proven by their
own measurements, scored by the real scorer. The subset holds cases the analyzer gets right
today, one per kind where one is fast (an attention collapse present from initialisation
included), and healthy controls: a detector change that breaks one
fails here before the full corpus is run."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "mlp_log_of_relu_weightless": "hit",  # -Inf from a weightless log, fed to a Linear
    "rnn_nonfinite_exp_rate_overflow": "hit",
    "mlp_deep_sigmoid_vanishing": "hit",
    "mlp_dead_relu_negative_bias_init": "hit",
    "transformer_attention_collapse_qk_init": "hit",  # one-hot from initialisation
    "rnn_exploding_spectral_radius_init": "hit",  # exploding from the first step, across depth
    "fresh_mlp_siren_default_hidden_init_explodes": "hit",  # (a fresh one: never tuned on)
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
