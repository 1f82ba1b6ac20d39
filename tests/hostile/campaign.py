"""A larger fuzzing campaign over every mutation class, with a table of counts for the issue.

    python -m tests.hostile.campaign --trials 300 --seed 1000 [--classes a,b] [--pdf-every 10]
                                     [--json results.json] [--budget-s 900]

Trial i uses class i mod (number of classes) and seed S + i div (number of classes), so any
trial is rebuilt with ``python -m tests.hostile.mutations CLASS SEED DIR``. Each trial runs
analyze (JSON and Markdown), info, load() touching
every view, one export in turn (--profile, --params last) and --memory-snapshot where the trace
has snapshots; HTML on every --html-every-th trial of a class, PDF every --pdf-every-th; a
trial's commands run one after another in one process (tests/hostile/run_case.py). Prints one
line per trial that broke the contract, then per class: trials, command runs, exit codes
(0/1/2/other), runs that broke the contract, exit-2 lines that came from the CLI's last-resort
handler ("caught": within the contract, but an unchecked path), worst wall time and peak RSS of
any run; then each distinct failure once, with a repro and the last lines of its output, and each
distinct last-resort line.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from tests.hostile.mutations import MUTATIONS, SAMPLES, make_trial
from tests.hostile.run_cli import commands, run_case

REPO = SAMPLES.parent


def failure_key(cls: str, r) -> tuple:
    """What makes two failing runs the same failure: for a traceback, the innermost frame in
    this repository and the exception type; otherwise the kinds of violation, the command and
    the class."""
    if not any(v.startswith("traceback") for v in r.violations):
        return ",".join(sorted({v.split(":")[0] for v in r.violations})), r.label, cls
    frames = re.findall(r'File "([^"]*)", line (\d+), in (\S+)', r.err + r.out)
    ours = [f for f in frames if f[0].startswith(str(REPO)) and "/.venv/" not in f[0]] or frames or [("?", "?", "?")]
    path, line, fn = ours[-1]
    exc = (r.err.strip() or r.out.strip()).splitlines()[-1].split(":")[0]
    return "traceback", f"{Path(path).relative_to(REPO) if path.startswith(str(REPO)) else path}:{line} {fn}", exc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--classes", default=",".join(MUTATIONS))
    ap.add_argument("--html-every", type=int, default=2, help="HTML on every Nth trial of a class (0: never)")
    ap.add_argument("--pdf-every", type=int, default=10, help="PDF on every Nth trial of a class (0: never)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting trials after this long")
    ap.add_argument("--json", dest="json_path", help="write every run's result here")
    args = ap.parse_args(argv)
    classes = args.classes.split(",")
    unknown = [c for c in classes if c not in MUTATIONS]
    if unknown:
        ap.error(f"unknown classes {unknown}; known: {', '.join(MUTATIONS)}")

    stats = defaultdict(lambda: {"trials": 0, "runs": 0, "rc": Counter(), "bad_runs": 0, "bad_trials": 0,
                                 "caught": 0, "wall": 0.0, "rss": 0, "kinds": Counter()})
    distinct: dict[tuple, dict] = {}
    caught: dict[str, dict] = {}  # exit 2 lines from the CLI's last-resort handler (within the contract)
    records = []
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="hostile-campaign-"))
    try:
        for i in range(args.trials):
            if args.budget_s and time.monotonic() - t_start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent after {i} trials", file=sys.stderr)
                break
            cls, seed = classes[i % len(classes)], args.seed + i // len(classes)
            d = work / f"t{i}"
            try:
                trial = make_trial(cls, seed, d / "run")
            except Exception as e:  # noqa: BLE001 - a mutator that cannot apply to this base is skipped
                print(f"[{i}] {cls} seed={seed}: mutation failed ({type(e).__name__}: {e})", file=sys.stderr)
                continue
            out = d / "out"
            out.mkdir()
            k = i // len(classes)  # the how-manieth trial of its class: spreads the slow outputs
            which = ["analyze", "info", "load", "memory", ("profile", "params")[k % 2]]
            which += [w for w, every in (("html", args.html_every), ("pdf", args.pdf_every))
                      if every and k % every == 0]
            runs = run_case(commands(trial.run_dir, out, trial.has_memory, which), out)
            s = stats[cls]
            s["trials"] += 1
            s["bad_trials"] += any(r.violations for r in runs)
            for r in runs:
                s["runs"] += 1
                s["rc"][r.rc if r.rc in (0, 1, 2) else "other"] += 1
                s["wall"], s["rss"] = max(s["wall"], r.wall_s), max(s["rss"], r.peak_rss)
                s["bad_runs"] += bool(r.violations)
                for v in r.violations:
                    s["kinds"][v.split(":")[0]] += 1
                repro = (f"python -m tests.hostile.mutations {cls} {seed} RUN && "
                         + r.command().replace(str(trial.run_dir), "RUN").replace(str(out), "OUT"))
                if r.caught():
                    s["caught"] += 1
                    line = re.sub(r"/\S*rank\d+\.h5", "RUN/rank0.h5", r.err.strip())[:300]
                    hit = caught.setdefault(line, {"count": 0, "where": set(), "label": trial.label, "repro": repro})
                    hit["count"] += 1
                    hit["where"].add(f"{r.label} on {cls}")
                if r.violations:
                    hit = distinct.setdefault(failure_key(cls, r), {
                        "count": 0, "violation": "; ".join(r.violations), "label": trial.label, "repro": repro,
                        "tail": r.tail(6)})
                    hit["count"] += 1
                records.append({"trial": i, "cls": cls, "seed": seed, "detail": trial.detail, "base": trial.base,
                                "command": r.label, "rc": r.rc, "wall_s": round(r.wall_s, 2),
                                "peak_rss_mib": round(r.peak_rss / 2**20), "violations": r.violations,
                                "caught": r.caught(), "stderr": r.err[-400:],
                                "tail": r.tail(6) if r.violations else ""})
            bad = [f"{r.label}: {'; '.join(r.violations)}" for r in runs if r.violations]
            if bad:
                print(f"[{i}] {trial.label[:160]!a}\n    " + "\n    ".join(x[:200] for x in bad), file=sys.stderr)
            shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print_table(stats, time.monotonic() - t_start)
    print(f"\n{len(distinct)} distinct failure(s):")
    for (kind, where, what), hit in sorted(distinct.items(), key=lambda kv: -kv[1]["count"]):
        print(f"\n- {kind} {where} {what} (x{hit['count']}): {hit['violation'][:160]}\n"
              f"  trial: {hit['label'][:200]!a}\n"
              f"  repro: {hit['repro']}")
        print("\n".join(f"  | {line[:200]}" for line in hit["tail"].splitlines()))
    print(f"\n{len(caught)} distinct exit-2 line(s) from the CLI's last-resort handler (not violations):")
    for line, hit in sorted(caught.items(), key=lambda kv: -kv[1]["count"]):
        print(f"\n- (x{hit['count']}, {', '.join(sorted(hit['where']))[:200]}): {line!a}\n"
              f"  trial: {hit['label'][:200]!a}\n  repro: {hit['repro']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"runs": records}, indent=1))
    return 1 if distinct else 0


def print_table(stats, elapsed: float) -> None:
    head = f"{'class':18} {'trials':>6} {'runs':>5} {'rc0':>5} {'rc1':>4} {'rc2':>5} {'other':>5} " \
           f"{'bad runs':>8} {'bad trials':>10} {'caught':>6} {'worst s':>8} {'worst MiB':>9}  violations"
    n = sum(s["trials"] for s in stats.values())
    print(f"\ncampaign: {n} trials in {elapsed:.0f} s\n\n{head}\n{'-' * len(head)}")
    total = {"trials": 0, "runs": 0, "rc": Counter(), "bad_runs": 0, "bad_trials": 0, "caught": 0, "wall": 0.0,
             "rss": 0, "kinds": Counter()}
    for cls, s in list(stats.items()) + [("TOTAL", total)]:
        if cls != "TOTAL":
            for k in ("trials", "runs", "bad_runs", "bad_trials", "caught"):
                total[k] += s[k]
            total["rc"].update(s["rc"])
            total["kinds"].update(s["kinds"])
            total["wall"], total["rss"] = max(total["wall"], s["wall"]), max(total["rss"], s["rss"])
        kinds = ", ".join(f"{k} {n}" for k, n in s["kinds"].most_common())
        print(f"{cls:18} {s['trials']:6} {s['runs']:5} {s['rc'][0]:5} {s['rc'][1]:4} {s['rc'][2]:5} "
              f"{s['rc']['other']:5} {s['bad_runs']:8} {s['bad_trials']:10} {s['caught']:6} {s['wall']:8.1f} "
              f"{s['rss'] / 2**20:9.0f}  {kinds}")


if __name__ == "__main__":
    sys.exit(main())
