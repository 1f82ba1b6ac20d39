"""Score the analyzer on the validation corpus (benchmarks/corpus/): recall, false alarms, and
where/step accuracy per finding kind, on the tuning half, the held-out half, or both.

    python benchmarks/score_corpus.py [--out DIR] [--jobs N] [--split tune|holdout|fresh|all]
                                      [--rerun] [--config FILE.toml] [--list] [NAME ...]

Each scenario trains in a process of its own (forked from this one) and writes DIR/<name>/run
(the trace), DIR/<name>/oracle.json (what its own measurements proved) and DIR/<name>/log.txt
(its output). Traces are kept: scoring again (after
a detector changed) re-analyzes them without training again, unless --rerun. Scoring runs the
analyzer in this process, with the detectors' defaults or --config's thresholds.

Verdicts. A broken scenario is *found* when a finding of its kind has severity warning or error;
its *where* is right when a name the finding gives matches one the oracle accepts (a parameter
matches its module, a module its parameters and submodules), or, for a NaN born in the loss
function (oracle where "<loss>"), when it names no module; its *step* is right when within the
oracle's tolerance. A healthy control raises a *false alarm* when any finding has severity
warning or error. Other warnings on a broken run are listed, not scored.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import multiprocessing
import multiprocessing.connection
import pkgutil
import shutil
import sys
import time
import traceback
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: benchmarks.corpus

from benchmarks.corpus.base import KINDS, LOSS, SCENARIOS, Oracle, split  # noqa: E402

TIMEOUT_S = 600


def discover() -> None:
    import benchmarks.corpus as pkg

    for m in pkgutil.iter_modules(pkg.__path__):
        if m.name != "base":
            importlib.import_module(f"benchmarks.corpus.{m.name}")


def run_one(name: str, out: str) -> None:
    """(In the child process.) Train, record, write oracle.json."""
    sc = SCENARIOS[name]
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    oracle = sc.run(os.path.join(d, "run"))
    assert isinstance(oracle, Oracle), f"{name} returned {type(oracle).__name__}, not an Oracle"
    assert oracle.kind == sc.kind, f"{name}: the oracle says {oracle.kind}, the scenario {sc.kind}: not proven"
    doc = {**asdict(oracle), "family": sc.family, "onset": sc.onset, "source": sc.source, "split": split(name),
           "seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(d, "oracle.json"), "w") as f:
        json.dump(doc, f, indent=1, default=float)


def _child(name: str, out: str, log: str) -> None:
    """(The forked child.) Its output to the scenario's log; an exception exits 1 with its line last."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    discover()  # (already imported where forked; a spawned child imports them here)
    run_one(name, out)


def train(names: list[str], out: str, jobs: int, rerun: bool) -> dict[str, str]:
    """Run the scenarios not run yet; {name: error line} of those that failed.

    Each scenario runs in a process of its own, forked from this one, which has imported torch
    and the corpus already (a fresh interpreter per scenario paid ~3 CPU-s of imports, as much as
    many scenarios' training); spawned where fork is not available. Nothing has computed with torch
    in this process yet (its thread pools are not started), and no thread runs here: forking is safe."""
    todo = [n for n in names if rerun or not os.path.exists(os.path.join(out, n, "oracle.json"))]
    errors: dict[str, str] = {}
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    running: dict = {}  # sentinel -> (name, process, start, log)

    def finish(sentinel, timed_out: bool):
        name, proc, t0, log = running.pop(sentinel)
        if timed_out:
            proc.kill()
        proc.join()
        ok = proc.exitcode == 0 and not timed_out
        why = ""
        if timed_out:
            why = f"timed out after {TIMEOUT_S} s"
        elif not ok:
            with open(log, errors="replace") as f:
                why = (f.read().strip().splitlines() or [f"exit status {proc.exitcode}"])[-1]
        print(f"  {'ran' if ok else 'FAILED'} {name} ({time.perf_counter() - t0:.0f} s){': ' + why if why else ''}",
              flush=True)
        if not ok:
            errors[name] = why

    queue = list(todo)
    while queue or running:
        while queue and len(running) < max(1, jobs):
            name = queue.pop(0)
            if rerun:
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
            os.makedirs(os.path.join(out, name), exist_ok=True)
            log = os.path.join(out, name, "log.txt")
            proc = ctx.Process(target=_child, args=(name, out, log), name=name)
            proc.start()
            running[proc.sentinel] = (name, proc, time.perf_counter(), log)
        now = time.perf_counter()
        deadline = min(t0 + TIMEOUT_S for _, _, t0, _ in running.values())
        ready = multiprocessing.connection.wait(list(running), timeout=max(0.0, deadline - now))
        for sentinel in ready:
            finish(sentinel, timed_out=False)
        for sentinel, (_, _, t0, _) in list(running.items()):
            if time.perf_counter() - t0 > TIMEOUT_S:
                finish(sentinel, timed_out=True)
    return errors


def _matches(reported: str, accepted: str) -> bool:
    """A name matches another, or one is the other's module (a prefix ending at a dot)."""
    return reported == accepted or reported.startswith(accepted + ".") or accepted.startswith(reported + ".")


def score(name: str, out: str, cfg) -> dict:
    from torchautopsy import load
    from torchautopsy.analyzer.run import analyze

    with open(os.path.join(out, name, "oracle.json")) as f:
        oracle = json.load(f)
    try:
        findings = analyze(load(os.path.join(out, name, "run")), cfg)
    except Exception as e:  # (reported, never hidden)
        return {**oracle, "name": name, "verdict": "analyzer failed", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=3)}
    loud = [f for f in findings if f.severity in ("warning", "error")]
    row = {**oracle, "name": name,
           "reported": [f"{f.kind}/{f.severity}/{f.step}/{','.join(f.where[:3])}" for f in loud]}
    if oracle["kind"] is None:
        row["verdict"] = "false alarm" if loud else "quiet"
        return row
    mine = [f for f in loud if f.kind == oracle["kind"]]
    if not mine:
        row["verdict"] = "missed"
        return row
    f = mine[0]
    if oracle["where"] == [LOSS]:  # born in the loss: no module named (or the model computing its loss)
        row["where_ok"] = f.where in ([], [""])
    else:
        row["where_ok"] = not oracle["where"] or any(_matches(r, a) for r in f.where for a in oracle["where"])
    row["step_ok"] = oracle["step"] is None or (f.step is not None and abs(f.step - oracle["step"]) <= oracle["step_tolerance"])
    row["found"] = {"step": f.step, "where": f.where[:5], "severity": f.severity}
    row["verdict"] = "hit" if row["where_ok"] and row["step_ok"] else \
        "found, " + " and ".join(w for w, ok in (("wrong place", row["where_ok"]), ("wrong step", row["step_ok"])) if not ok)
    return row


def report(rows: list[dict]) -> str:
    lines = []
    for part in ("tune", "holdout", "fresh", "all"):
        sel = [r for r in rows if part == "all" or r["split"] == part]
        if not sel:
            continue
        lines.append(f"\n== {part}: {len(sel)} scenarios ==")
        lines.append(f"{'kind':22} {'n':>3} {'found':>6} {'where':>6} {'step':>6} {'hit':>4}")
        for kind in KINDS:
            k = [r for r in sel if r["kind"] == kind]
            if k:
                found = [r for r in k if r["verdict"] not in ("missed", "analyzer failed")]
                lines.append(f"{kind:22} {len(k):3} {len(found):6} {sum(r.get('where_ok', False) for r in k):6} "
                             f"{sum(r.get('step_ok', False) for r in k):6} {sum(r['verdict'] == 'hit' for r in k):4}")
        healthy = [r for r in sel if r["kind"] is None]
        if healthy:
            lines.append(f"{'healthy (false alarms)':22} {len(healthy):3} "
                         f"{sum(r['verdict'] == 'false alarm' for r in healthy):6}")
    lines.append("\n== each scenario ==")
    for r in sorted(rows, key=lambda r: (r["kind"] or "~", r["name"])):
        extra = f" found {r['found']}" if "found" in r else ""
        oracle = f"oracle step {r['step']} where {r['where'][:3]}" if r["kind"] else ""
        lines.append(f"{r['split']:7} {r['family']:11} {r['name']:34} {r['verdict']:24} {oracle}{extra}")
        if r["verdict"] in ("missed", "false alarm") or r["verdict"].startswith("found,"):
            lines.append(f"{'':20}reported: {'; '.join(r.get('reported', [])) or 'nothing'}")
        if "error" in r:
            lines.append(f"{'':20}{r['error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*")
    p.add_argument("--out", default=os.path.join(HERE, "results", "corpus"))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--split", choices=("tune", "holdout", "fresh", "all"), default="all")
    p.add_argument("--rerun", action="store_true", help="train again even where a trace is kept")
    p.add_argument("--config", help="detector thresholds (TOML), as analyze --config")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--json", help="write every scenario's verdict here")
    args = p.parse_args(argv)
    discover()
    names = args.names or [n for n in SCENARIOS if args.split == "all" or split(n) == args.split]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s): {', '.join(unknown)}")
    if args.list:
        for n in names:
            s = SCENARIOS[n]
            print(f"{split(n):7} {s.family:11} {n:34} {s.kind or 'healthy':20} {s.onset:7} {s.source}")
        return 0
    print(f"{len(names)} scenarios; traces in {args.out}", flush=True)
    errors = train(names, args.out, args.jobs, args.rerun)
    cfg = None
    if args.config:
        from torchautopsy.analyzer.config_file import load_config

        cfg = load_config(args.config)
    rows = [score(n, args.out, cfg) for n in names if n not in errors]
    print(report(rows))
    if errors:
        print(f"\n{len(errors)} scenario(s) failed to run: " + "; ".join(f"{n}: {e}" for n, e in errors.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
