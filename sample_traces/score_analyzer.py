"""Run the analyzer on every sample trace and compare with expected.json: a Markdown table.

    python sample_traces/score_analyzer.py [--samples DIR] [--json OUT.json]

Verdicts: "hit" (a warning/error of the expected kind, at the expected step, naming at least one
expected module/parameter); "hit (step within resolution)" when the step differs only because the
data is recorded per window (dead_relu: the window holding the true step) or per sample
(attention_collapse: the first sampled step at or after it), or within expected.json's
step_tolerance (a leak's onset fitted to a noisy line); "wrong step", "wrong layer" (", names
no module" when the finding names none where one is expected), "miss"
(no warning/error of that kind; "miss (info only)" if an info finding of that kind exists);
on healthy runs "ok" or "false alarm". Other warnings/errors are listed beside the verdict.
Needs no torch (the analyzer never imports it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from torchautopsy import load
from torchautopsy.analyzer.run import analyze

HERE = os.path.dirname(os.path.abspath(__file__))


def _resolution(kind: str, trace, true_step: int, found_step: int) -> bool:
    rt = trace.ranks[0]
    if kind == "dead_relu":
        for start, end, *_ in rt.activity_windows():
            if start <= true_step <= end:
                return found_step == start
        return False
    if kind == "attention_collapse":
        steps = rt.attention_stat("entropy").index.to_numpy()
        later = steps[steps >= true_step]
        return later.size > 0 and found_step == int(later[0])
    return False


def score(samples: str) -> list[dict]:
    with open(os.path.join(samples, "expected.json")) as f:
        expected = json.load(f)
    rows = []
    for case, exp in expected.items():
        trace = load(os.path.join(samples, case))
        findings = [f.to_dict() for f in analyze(trace)]
        serious = [f for f in findings if f["severity"] in ("error", "warning")]
        row = {"case": case, "architecture": exp["evidence"].get("architecture", ""), "expected": exp,
               "findings": findings}
        if exp["kind"] is None:
            row["verdict"] = "false alarm on healthy" if serious else "ok"
            row["match"] = None
            row["others"] = serious
        else:
            hits = [f for f in serious if f["kind"] == exp["kind"]]
            row["others"] = [f for f in serious if f["kind"] != exp["kind"]]
            if not hits:
                info = [f for f in findings if f["kind"] == exp["kind"]]
                row["verdict"] = "miss (info only)" if info else "miss"
                row["match"] = info[0] if info else None
            else:
                f = hits[0]
                row["match"] = f
                step_ok = f["step"] == exp["step"]
                near = not step_ok and f["step"] is not None and (
                    abs(f["step"] - exp["step"]) <= exp.get("step_tolerance", 0)
                    or _resolution(exp["kind"], trace, exp["step"], f["step"]))
                where_ok = bool(set(exp["where"]) & set(f["where"])) or (not exp["where"] and not f["where"])
                rank_ok = exp.get("rank") is None or f["rank"] == exp["rank"]  # (a many-rank case)
                unnamed = bool(exp["where"]) and not f["where"]
                if not rank_ok:
                    row["verdict"] = f"wrong rank ({f['rank']}, not {exp['rank']})"
                elif unnamed:
                    row["verdict"] = ("hit" if step_ok else "hit (step within resolution)" if near
                                      else "wrong step") + ", names no module"
                elif not where_ok:
                    row["verdict"] = "wrong layer" + ("" if step_ok or near else " and wrong step")
                elif step_ok:
                    row["verdict"] = "hit"
                elif near:
                    row["verdict"] = "hit (step within resolution)"
                else:
                    row["verdict"] = "wrong step"
        rows.append(row)
    return rows


def _f(f: dict | None) -> str:
    if f is None:
        return "-"
    return f"{f['kind']} / {f['severity']} / step {f['step']} / {', '.join(f['where']) or '[]'}"


def markdown(rows: list[dict]) -> str:
    out = ["| case | architecture | expected: kind, step, where | analyzer: kind / severity / step / where "
           "| verdict | other warnings/errors |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        e = r["expected"]
        exp = "none (healthy)" if e["kind"] is None else f"{e['kind']}, {e['step']}, {', '.join(e['where']) or '[]'}"
        found = _f(r["match"]) if e["kind"] is not None else "-"
        others = "; ".join(_f(f) for f in r["others"]) or "-"
        out.append(f"| {r['case']} | {r['architecture']} | {exp} | {found} | {r['verdict']} | {others} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", default=HERE)
    p.add_argument("--json", help="write every finding, per case, to this file")
    args = p.parse_args(argv)
    rows = score(args.samples)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
