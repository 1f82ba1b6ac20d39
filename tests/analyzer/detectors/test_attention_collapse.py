"""attention_collapse: a layer's heads near one-hot (mean entropy < 0.1), all on one key (sink
share > 0.95 for every head), or alike and sharp, on the last 2 samples and dated from where it held."""

from tests.tracebuilder import TraceBuilder, findings

KIND = "attention_collapse"
SAMPLES = list(range(0, 100, 10))


def model(**stats) -> TraceBuilder:
    b = TraceBuilder(["attn.in_proj_weight", "attn.out_proj.weight", "out.weight"],
                     [("", "Model"), ("attn", "MultiheadAttention"), ("attn.out_proj", "Linear"), ("out", "Linear")],
                     steps=100).loss(1.0).total_grad_norm(1.0)
    b.attention_site("attn", heads=4)
    return b.attention(SAMPLES, **stats)


def from_step(step, before, after):
    return {"attn": [[before] * 4 if s < step else [after] * 4 for s in SAMPLES]}


def test_entropy_collapse_from_step_50(tmp_path):
    model(entropy=from_step(50, 0.6, 0.05), sink_share=from_step(0, 0.3, 0.3)).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("warning", 50, ["attn"])
    assert f.evidence["collapse"] == "entropy" and f.evidence["heads"] == 4


def test_every_head_on_one_key(tmp_path):
    model(entropy=from_step(0, 0.4, 0.4), sink_share=from_step(70, 0.5, 0.99)).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.where, f.evidence["collapse"]) == (70, ["attn"], "sink")


def test_heads_alike_and_sharp(tmp_path):
    model(entropy=from_step(0, 0.3, 0.3), head_similarity={"attn": [0.5] * 6 + [0.999] * 4}).write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.step, f.evidence["collapse"]) == (60, "alike")


def test_uniform_heads_and_one_sharp_head_are_healthy(tmp_path):
    # Near-uniform heads are alike at initialisation; one previous-token head is a specialist.
    model(entropy={"attn": [0.01, 0.9, 0.9, 0.9]}, head_similarity={"attn": 0.999},
          sink_share={"attn": [0.99, 0.2, 0.2, 0.2]}).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_collapse_on_the_last_sample_only_is_not_yet_one(tmp_path):
    model(entropy=from_step(90, 0.6, 0.05)).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_no_attention_recorded(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).loss(1.0).write(tmp_path)
    assert findings(tmp_path, KIND) == []


def test_trace_without_attention_tables_is_not_checked(tmp_path):
    TraceBuilder.mlp(layers=3, steps=100).without("attention", "attention_sites").write(tmp_path)
    (f,) = findings(tmp_path, KIND)
    assert (f.severity, f.step, f.where) == ("info", None, [])
    assert f.evidence["lacking"] == ["attention/entropy", "attention_sites/heads"]
