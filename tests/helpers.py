"""Shared test helpers: run the CLI as a subprocess (run_cli: the real process, its exit status,
an interpreter where torch cannot be imported), in this process (invoke_cli: ~1.3 CPU-s less a
call, the interpreter's start and the analyzer's imports, for tests about what a command says
or writes), or many commands in one bounded child (BoundedCLI: a memory limit, a timeout that
kills a hang, a crash kept out of the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_traces"
# How many times a test that repeats a whole job to catch a rare failure runs it: once in the
# suite; TORCHAUTOPSY_REPEAT=20 to count a rate (the exit-status and full-disk jobs).
REPEAT = int(os.environ.get("TORCHAUTOPSY_REPEAT", "1"))


def run_cli(*args, block_torch: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    """`torchautopsy ARGS...` in a fresh interpreter; with block_torch, `import torch` fails."""
    prelude = "import sys\n"
    if block_torch:
        prelude += "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
    code = prelude + "from torchautopsy.analyzer.cli import main\nmain(sys.argv[1:])\n"
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _needs_torch(module_name: str) -> bool:
    return any(part.startswith("torch") and part != "torchautopsy" for part in module_name.split("."))


def invoke_cli(*args, block_torch: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchautopsy ARGS...` in this process, through the same main() (its exit codes, its one
    line on stderr), with stdout and stderr of its own (click's CliRunner isolation: not a
    terminal, as in run_cli) and ``env`` set for the call. Returns what run_cli returns.

    With block_torch, the torch modules this process loaded are hidden for the call (those
    named torch*, and at any depth, as safetensors.torch; not torchautopsy): an ``import torch``
    or ``from torch.x import y`` that the command reaches raises ImportError, as in run_cli's
    interpreter without torch. (Modules that import torch under another name, as transformers,
    stay importable here.) The CLI's own imports without torch are proved by the run_cli tests
    that keep block_torch (tests/reports/test_report_cli.py, tests/analyzer/test_tracebuilder_format.py)."""
    from click.testing import CliRunner

    from torchautopsy.analyzer.cli import main

    argv = [str(a) for a in args]
    hidden = {name: mod for name, mod in sys.modules.items() if _needs_torch(name)} if block_torch else {}
    with CliRunner().isolation(env={"MPLBACKEND": "Agg", **(env or {})}) as (out, err, _):
        sys.modules.update(dict.fromkeys(hidden, None))
        if block_torch:
            sys.modules["torch"] = None
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            for name in hidden:
                sys.modules[name] = hidden[name]
            if block_torch and "torch" not in hidden:
                del sys.modules["torch"]
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    return subprocess.CompletedProcess(["torchautopsy", *argv], code, stdout, stderr)


def rank_copies(run, n_ranks: int, sample: str = "healthy_mlp"):
    """``run`` made a run directory of ``n_ranks`` copies of a sample's rank file, each with its
    own rank and the world size in its attributes (the reader checks them against the name)."""
    import shutil

    import h5py

    run.mkdir()
    for r in range(n_ranks):
        shutil.copy(SAMPLES / sample / "rank0.h5", run / f"rank{r}.h5")
        with h5py.File(run / f"rank{r}.h5", "r+") as f:
            f.attrs["rank"], f.attrs["world_size"] = r, n_ranks
    return run


_SERVE = r"""
import json, os, resource, sys
mem_bytes, block_torch = int(sys.argv[1]), sys.argv[2] == "1"
if block_torch:
    sys.modules["torch"] = None  # any import of torch now raises ImportError
if mem_bytes:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    except (ValueError, OSError):
        pass
replies = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray write to fd 1 would garble the replies
from tests.helpers import invoke_cli
for line in sys.stdin:
    args, env = json.loads(line)
    r = invoke_cli(*args, env=env)
    replies.write(json.dumps([r.returncode, r.stdout, r.stderr]) + "\n")
    replies.flush()
"""


class BoundedCLI:
    """`torchautopsy ARGS...` in one child process (where torch cannot be imported with
    ``block_torch``, and that may not map more than ``mem_bytes``: Linux's RLIMIT_AS), each command
    given at most ``timeout`` seconds: the child is killed past it, as a hang in C code is, and a
    crash of the child is that command's. The bounds of a process, with its interpreter's start and
    the analyzer's imports paid once for many commands. A call (``env``: set for that command)
    returns what run_cli returns and the command's wall time; if the child died, its exit status
    and stderr; the next call starts a new child."""

    def __init__(self, mem_bytes: int = 0, block_torch: bool = False, timeout: float = 60):
        self.mem_bytes, self.block_torch, self.timeout, self.proc = mem_bytes, block_torch, timeout, None

    def __call__(self, *args, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
        import json
        import select
        import tempfile
        import time

        if self.proc is None or self.proc.poll() is not None:
            self.err = tempfile.TemporaryFile()
            flags = [str(self.mem_bytes), "1" if self.block_torch else "0"]
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, *flags], cwd=REPO, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        argv = [str(a) for a in args]
        t0 = time.monotonic()
        try:
            self.proc.stdin.write(json.dumps([argv, env or {}]) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it died starting: told below
            pass
        if not select.select([self.proc.stdout], [], [], self.timeout)[0]:
            self.close()
            raise subprocess.TimeoutExpired(argv, self.timeout)
        line = self.proc.stdout.readline()
        seconds = time.monotonic() - t0
        if not line:  # the child died (a crash, or an exception out of main)
            code = self.proc.wait()
            self.err.seek(0)
            return subprocess.CompletedProcess(argv, code, "", self.err.read().decode()), seconds
        code, out, err = json.loads(line)
        return subprocess.CompletedProcess(argv, code, out, err), seconds

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
