"""The verdict's phrase of each variant of a finding says its own numbers, never a placeholder
(issue 37: "to ?x their early norm" for an explosion judged across depth from the start)."""

from torchautopsy.analyzer.findings import Finding
from torchautopsy.reports.sections import section
from torchautopsy.reports.summary import first_fix


def _phrase(evidence: dict) -> str:
    f = Finding("exploding_gradients", "warning", 0, ["0.weight"], "", evidence, "")
    return "".join(s.text for s in section("exploding_gradients").phrase([f]))


def test_each_exploding_variant_says_its_own_number():
    assert "120x the late layers'" in _phrase({"early_to_late_rms_ratio": 120.0})
    assert "growing 300x through depth" in _phrase({"activation_growth": 300.0})
    assert "to 50x their early norm" in _phrase({"ratio_at_step": 50.0})
    for ev in ({"early_to_late_rms_ratio": 120.0}, {"activation_growth": 300.0}, {"parameters": 3}):
        assert "?" not in _phrase(ev), ev


def test_the_first_fix_is_a_whole_sentence():
    assert first_fix("Call it once (e.g. under `if rank == 0:`). Then more.") == \
        "Call it once (e.g. under `if rank == 0:`)."
    assert first_fix("Lower the lr (3-10x). Clip.") == "Lower the lr (3-10x)."
    assert first_fix("No full stop") == "No full stop"
