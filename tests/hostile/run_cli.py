"""Run the real CLI (and the load() API) on a trace and check issue 20's contract.

A case's commands run one after another in one process (run_case.py's main, through the CLI's
real entry point), forked from a server that imported the analyzer once (runner_server.py: the
same process a fresh `python run_case.py` was, without its start), in its own process group;
each command's peak memory is its own (the runner resets VmHWM before it and reads it after),
the runner is polled for VmHWM and killed past KILL_RSS (a memory bomb must not take the machine
down) or when a command runs past the time limit, and if it dies the command in flight is the one
reported (a fresh runner takes the rest). The contract, for each command:

- exit code 0 or 2 (no command here passes --fail-on, so 1 can only mean an uncaught error, and
  unusable input must be 2, never 1); exit 2 means exactly one non-empty line on stderr;
- never "Traceback"; no raw control character (C0 but \\n and \\t, DEL, C1; ESC is C0) in stdout,
  stderr or the Markdown report; no injected markup unescaped in the HTML or the Markdown;
- at most 60 s and 1 GiB; a report asked for is written when analyze exits 0;
- load() works or raises a TraceError subclass (analyzer/errors.py), nothing else;
- the memory-snapshot pickle loads with an unpickler that refuses every global.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import pickle
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.hostile.runner_client import RunnerServer

TIME_LIMIT_S = 60
RSS_LIMIT = 1 << 30
KILL_RSS = 3 << 30
# The progress bar (tqdm: "\r" and cursor moves on stderr) turns itself on for huge runs even
# when stderr is not a terminal; it is the tool's own output, not the trace's, so it is off here
# and the control-character check sees only what the trace could have put there.
ENV = {**{k: v for k, v in os.environ.items() if k != "TORCHAUTOPSY_DEBUG"},  # DEBUG re-raises: tracebacks
       "MPLBACKEND": "Agg", "TORCHAUTOPSY_PROGRESS": "0", "COLUMNS": "120"}
# The CLI's last-resort handler turns any exception into one line and exit 2: within the contract,
# but a sign of a path that does not check its input. The campaign counts these lines apart.
CAUGHT = re.compile(r"could not finish \((\w+)|more than this machine can give \((\w+)\)")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
HTML_INJECTED = [re.compile(r"<script>alert\(1\)"), re.compile(r"<img src=x"),
                 re.compile(r'<[a-zA-Z][^<>]*\sonmouseover="alert\(3\)')]
# Markdown escapes with a backslash: an unescaped tag or link target is live markup.
MD_INJECTED = [re.compile(r"(?<!\\)<(script|img)\b"), re.compile(r"(?<!\\)\]\(javascript:")]
CLI = [sys.executable, "-m", "torchautopsy.analyzer.cli"]

# Touches every RankTrace view; a TraceError anywhere is fine (the view's data is damaged),
# anything else escapes as a traceback. Messages are printed with ascii(): this is our driver,
# the CLI runs are where terminal output is judged.
TOUCH = r"""
import sys
import numpy as np
import torchautopsy
from torchautopsy.analyzer.errors import TraceError
from torchautopsy.analyzer.trace import ACTIVATION_STATS, HIST_KINDS, PARAM_STATS, STEP_COLUMNS
try:
    trace = torchautopsy.load(sys.argv[1])
except TraceError as e:
    print(f"load: {type(e).__name__}: {e!a}"[:2000], file=sys.stderr)
    sys.exit(2)
for rt in trace.ranks.values():
    def stored():
        t = rt.stored_tensors
        kept = {int(s) for s in rt.snapshots["step"]}  # verify a snapshot's crc as export does: kept ones
        for src, step in list(dict.fromkeys(zip(t["source"], t["step"])))[:4]:
            rows = rt.tensors_of(src, int(step))
            rt.read_tensor_bytes(rows, int(step) if src == "snapshot" and int(step) in kept else None)
    def memory():
        s = rt.memory_snapshots
        for n in list(s["snapshot"])[:3]:
            rt.memory_snapshot_rows(int(n))
        rt.memory_stack(0)
        return rt.oom_events, rt.oom_tensor_groups
    def profile():
        rt.profile_ops()
        for w in list(rt.profile_windows["window"])[:2]:
            rt.profile_trace(int(w))
    views = {
        "meta": lambda: (rt.meta, rt.rank, rt.n_steps, rt.closed_cleanly, rt.wall_time_s, rt.step_index),
        "steps": lambda: rt.columns.frame(STEP_COLUMNS),
        "param_stat": lambda: [rt.param_stat(s) for s in PARAM_STATS],
        "module_stat": lambda: rt.module_stat(),
        "activation_stat": lambda: [rt.activation_stat(s) for s in ACTIVATION_STATS],
        "update_ratio": lambda: rt.update_ratio(),
        "attention_stat": lambda: [rt.attention_stat(s) for s in
                                   ("entropy", "max_weight", "sink_share", "head_similarity", "keys")],
        "activity_windows": lambda: (rt.activity_sites, [w for w in rt.activity_windows()]),
        "histograms": lambda: [rt.histograms(k) for k in HIST_KINDS],
        "stored_tensors": stored,
        "blackbox": lambda: (rt.blackbox, rt.snapshots),
        "memory_snapshots": memory,
        "profile_ops": profile,
        "census_groups": lambda: (rt.census_groups, rt.module_outputs, rt.attention_sites),
        "digest": lambda: (rt.digest, rt.total_grad_norm,
                           rt.bucketed("params/grad_norm", np.linspace(0, rt.n_steps, 5).astype(int))),
        "sampled": lambda: [rt.sample_steps(t) for t in ("activations", "updates")],
    }
    for name, fn in views.items():
        try:
            fn()
            print(f"{name}: ok")
        except TraceError as e:
            print(f"{name}: {type(e).__name__}: {e!a}"[:300])
"""


@dataclass
class Run:
    label: str
    argv: list[str]
    rc: int
    out: str
    err: str
    wall_s: float
    peak_rss: int  # bytes
    killed: str | None  # "timeout" | "memory"
    files: dict[str, Path] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def command(self) -> str:
        head = "torchautopsy" if self.argv[:3] == CLI else "python -m tests.hostile.run_cli"  # or the load() driver
        return " ".join([head, *self.argv[3:]])

    def caught(self) -> str | None:
        """The exception type the CLI's last-resort handler reported, if it did."""
        m = CAUGHT.search(self.err) if self.rc == 2 else None
        return (m.group(1) or m.group(2)) if m else None

    def tail(self, n: int = 8) -> str:
        return "\n".join((self.err.strip() or self.out.strip()).splitlines()[-n:])


_SERVER: RunnerServer | None = None


def runner_server() -> RunnerServer:
    """This process's runner server, started at its first case (closed by close_runner_server,
    or at exit)."""
    global _SERVER
    if _SERVER is not None and not _SERVER.alive():
        close_runner_server()  # (a server that died: reaped, its runners' groups killed)
    if _SERVER is None:
        _SERVER = RunnerServer(ENV)
    return _SERVER


def close_runner_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER, server = None, _SERVER
        server.close()


atexit.register(close_runner_server)  # (the campaign's; the tests close it in a module fixture)


def _vm_hwm(pid: int) -> int:
    """The runner's peak RSS (VmHWM) since its last reset, 0 if not readable (gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, ValueError, StopIteration):
        return 0


def _status(folder: Path) -> tuple[int | None, dict[int, tuple[int, float, int]]]:
    """The runner's status file: the last command started, and {index: (rc, wall_s, peak)} of those done."""
    started, done = None, {}
    try:
        lines = (folder / "status").read_text().splitlines()
    except OSError:
        return None, {}
    for line in lines:
        word, *rest = line.split()
        if word == "start":
            started = int(rest[0])
        elif word == "done" and len(rest) == 4:
            done[int(rest[0])] = (int(rest[1]), float(rest[2]), int(rest[3]))
    return started, done


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", "replace") if path.exists() else ""


def _one_runner(cmds, cwd, timeout: float) -> list[Run]:
    """Start run_case.py on the commands and watch it: a command in flight past ``timeout``, the
    case past ``timeout`` per command, or the process past KILL_RSS is killed. Returns the Runs of
    the commands it finished and of the one in flight if it died (a signal, a native crash, a kill):
    that one carries the runner's exit status, so check() reports it by name."""
    with tempfile.TemporaryDirectory(prefix="hostile-case-") as tmp:
        d = Path(tmp)
        (d / "spec.json").write_text(json.dumps([{"label": c[0], "argv": list(map(str, c[1]))} for c in cmds]))
        p = runner_server().start(d, cwd)  # its own process group: a kill takes what it started
        t0 = time.monotonic()
        current, t_current, polled, killed = None, t0, 0, None
        while p.poll() is None:
            started, done = _status(d)
            if started is not None and started not in done and started != current:
                current, t_current, polled = started, time.monotonic(), 0  # the runner reset VmHWM before "start"
            polled = max(polled, _vm_hwm(p.pid))
            now = time.monotonic()
            if polled > KILL_RSS or (current is not None and current not in done and now - t_current > timeout) \
                    or now - t0 > timeout * len(cmds):
                killed = "memory" if polled > KILL_RSS else "timeout"
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                break
            time.sleep(0.02)
        end = time.monotonic()
        started, done = _status(d)
        runs = []
        for i, (label, argv, files) in enumerate(cmds):
            if i in done:
                rc, wall, peak = done[i]
                runs.append(Run(label, list(map(str, argv)), rc, _read(d / f"{i}.out"), _read(d / f"{i}.err"),
                                wall, peak, None, files or {}))
                continue
            # Not finished: the runner died in it (or, with no "start" line for it, before it).
            err = _read(d / f"{i}.err") if started == i else ""
            err += _read(d / "runner.err")
            wall = end - (t_current if current == i else t0)
            runs.append(Run(label, list(map(str, argv)), p.returncode, _read(d / f"{i}.out") if started == i else "",
                            err, wall, polled, killed, files or {}))
            break
    return runs


def run_case(cmds, cwd, timeout: float = TIME_LIMIT_S) -> list[Run]:
    """Run a case's commands ((label, argv, files) as commands() gives them) one after another in
    one process (run_case.py's main in a runner forked from runner_server(): the analyzer's
    import once a test process, not once a case nor a command), and check each against the
    contract. If the runner dies, the command in flight is
    reported and a fresh runner takes the rest."""
    runs: list[Run] = []
    while len(runs) < len(cmds):
        runs += _one_runner(cmds[len(runs):], cwd, timeout)
    for r in runs:
        r.violations = check(r)
    return runs


def run(label: str, argv: list[str], cwd, files: dict[str, Path] | None = None,
        timeout: float = TIME_LIMIT_S) -> Run:
    """One command, checked (the checker's own test)."""
    return run_case([(label, argv, files)], cwd, timeout)[0]


def _signal_name(n: int) -> str:
    try:
        return f"killed by {signal.Signals(n).name}"
    except ValueError:
        return f"killed by signal {n}"


def check(r: Run) -> list[str]:
    v = []
    if r.killed:
        v.append(f"{r.killed}: killed after {r.wall_s:.0f} s at {r.peak_rss / 2**20:.0f} MiB")
    elif r.wall_s > TIME_LIMIT_S:
        v.append(f"timeout: {r.wall_s:.0f} s")
    if r.peak_rss > RSS_LIMIT and r.killed != "memory":
        v.append(f"memory: peak RSS {r.peak_rss / 2**20:.0f} MiB")
    if "Traceback" in r.out or "Traceback" in r.err:
        v.append("traceback: " + r.tail(1)[:200])
    if r.killed is None and r.rc not in (0, 2):
        v.append(f"exit_code: {r.rc}" + (f" ({_signal_name(-r.rc)})" if r.rc < 0 else ""))
    if r.rc == 2:
        lines = [line for line in r.err.splitlines() if line.strip()]
        if len(lines) != 1:
            v.append(f"stderr_lines: exit 2 with {len(lines)} non-empty stderr lines")
    for stream, text in (("stdout", r.out), ("stderr", r.err)):
        m = CONTROL.search(text)
        if m and r.label != "load":
            v.append(f"control_chars: {m.group()!a} on {stream}")
    for kind, path in r.files.items():
        v += _check_file(kind, path, r.rc == 0 and r.killed is None)
    return v


def _check_file(kind: str, path: Path, should_exist: bool) -> list[str]:
    if not path.exists():
        return [f"missing_output: exit 0 but no {path.name}"] if should_exist and kind != "pickle" else []
    if kind == "pickle":
        return _check_pickle(path)
    text = path.read_text("utf-8", "replace")
    if kind == "json":
        try:
            doc = json.loads(text)
            assert isinstance(doc, dict) and isinstance(doc.get("findings"), list)
        except (ValueError, AssertionError):
            return ["bad_json: the --json output is not {\"findings\": [...]}"]
        return []
    v = []
    if kind == "md":
        m = CONTROL.search(text)
        if m:
            v.append(f"control_chars: {m.group()!a} in the Markdown")
    for pat in HTML_INJECTED if kind == "html" else MD_INJECTED if kind == "md" else []:
        m = pat.search(text)
        if m:
            v.append(f"markup: unescaped {m.group()[:40]!a} in the {kind.upper()} report")
    return v


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name}")


def _check_pickle(path: Path) -> list[str]:
    try:
        _NoGlobals(io.BytesIO(path.read_bytes())).load()
    except Exception as e:  # noqa: BLE001 - any failure to load as plain data is the finding
        return [f"pickle: the memory snapshot does not load as plain data ({type(e).__name__}: {e})"[:200]]
    return []


def commands(run_dir: Path, out: Path, has_memory: bool,
             which=("analyze", "html", "info", "load", "profile", "params", "memory")) -> list[tuple]:
    """(label, argv, files) of the commands to run, as ``which`` picks them: analyze writes JSON
    and Markdown, and HTML or PDF where "html" or "pdf" is in ``which`` (those cost seconds)."""
    rd = str(run_dir)
    cmds = []
    if "analyze" in which:
        files = {"json": out / "f.json", "md": out / "r.md"}
        files.update({k: out / f"r.{k}" for k in ("html", "pdf") if k in which})
        argv = CLI + ["analyze", rd] + [a for k, p in files.items() for a in (f"--{k}", str(p))]
        cmds.append(("analyze" + "".join(f"+{k}" for k in ("html", "pdf") if k in which), argv, files))
    if "info" in which:
        cmds.append(("info", CLI + ["info", rd], {}))
    if "load" in which:
        cmds.append(("load", [sys.executable, "-c", TOUCH, rd], {}))
    if "profile" in which:
        cmds.append(("export --profile", CLI + ["export", rd, "--profile", str(out / "p.json")], {}))
    if "params" in which:
        cmds.append(("export --params", CLI + ["export", rd, "--params", "last", str(out / "p.safetensors")], {}))
    if "memory" in which and has_memory:
        pk = out / "m.pickle"
        cmds.append(("export --memory-snapshot", CLI + ["export", rd, "--memory-snapshot", str(pk)], {"pickle": pk}))
    return cmds


if __name__ == "__main__":  # python -m tests.hostile.run_cli RUN: the load() driver alone, to reproduce
    os.execv(sys.executable, [sys.executable, "-c", TOUCH, *sys.argv[1:]])
