"""Fuzzing-case runners forked from one interpreter that imported the analyzer once.

A fresh `python tests/hostile/run_case.py DIR` paid the interpreter's start and the analyzer's
import (~0.9 CPU-s; ~1.5 with the reports, matplotlib and fpdf2) before a case's first command:
that was most of a case's CPU. ``RunnerServer`` (runner_client.py) starts this file as a script,
which imports PRELOAD (never torch: the CLI runs without it, and the server checks it is not
imported), then forks a runner per case, which does exactly what run_case.py's main does in a
fresh process:

- the runner is a process group of its own (pid == pgid), stdin /dev/null, stdout and stderr the
  case's ``runner.err``, working directory the case's, environment run_cli.ENV (what the fresh
  runner got; the server's differs at most in OMP_NUM_THREADS, see RunnerServer);
- the runner's ``poll()``/``wait()`` (runner_client.py) give its status as Popen's returncode
  (negative: the signal that ended it), so run_cli watches it (VmHWM from /proc, killpg past
  KILL_RSS or the time limit) and reports a death as before;
- the preload must write nothing to stderr (checked at start): a warning printed at import is
  then not one a command's own stderr would lose.

The server is the test process's child, and reaps the runners: their CPU time counts in the
test process's (as a fresh runner's did). ``close()`` (the test module's fixture; atexit too,
for the campaign) SIGKILLs runners left and the server, which also exits when its socket closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

# What a case's commands import: the CLI, load()'s package, the reports (HTML, PDF, Markdown,
# terminal) and what they draw with. Measured on a case with HTML and PDF: everything it
# imports that the CLI's import does not is under these.
PRELOAD = ("torchautopsy", "torchautopsy.analyzer.cli", "torchautopsy.analyzer.restarts",
           "torchautopsy.reports.build", "torchautopsy.reports.html", "torchautopsy.reports.pdf",
           "torchautopsy.reports.markdown", "torchautopsy.reports.terminal",
           "matplotlib.backends.backend_agg", "fpdf", "jinja2", "PIL.Image")


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve(sock: socket.socket) -> tuple[dict, None] | None:
    """The server's loop; returns a request in the forked runner, None in the server at its end."""
    import importlib
    import run_case  # noqa: F401  (this file's folder is sys.path[0], as it was run_case.py's)
    for name in PRELOAD:
        importlib.import_module(name)
    assert "torch" not in sys.modules, "the analyzer's CLI imported torch: it must run without it"
    import gc
    gc.freeze()  # a runner's collections and exit then write to fewer pages shared with the server
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    running: set[int] = set()

    def send(msg):
        sock.send(json.dumps(msg).encode())

    sys.stderr.flush()
    send({"ready": os.getpid()})
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            send({"exited": pid, "status": os.waitstatus_to_exitcode(status)})
        if sock not in ready:
            continue
        data = sock.recv(1 << 16)
        if not data:  # the test process closed its end: the runners left go with it
            for pid in running:
                kill_group(pid)
                os.waitpid(pid, 0)
            return None
        request = json.loads(data)
        try:
            threads = len(os.listdir("/proc/self/task"))
            if threads != 1:
                raise RuntimeError(f"{threads} threads in the server: a fork copies their locks, held or not")
            pid = os.fork()
        except Exception as e:  # noqa: BLE001 - told to the test process
            send({"error": f"{type(e).__name__}: {e}"})
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_r), os.close(wake_w), sock.close()
            return request
        try:
            os.setpgid(pid, pid)  # (the runner does it too: whichever runs first)
        except OSError:
            pass
        running.add(pid)
        send({"started": pid})


def runner(request: dict) -> int:
    """In the forked process: run_case.py's main, as `python run_case.py DIR` would run it."""
    import traceback
    import run_case
    os.setpgid(0, 0)
    err = os.open(os.path.join(request["dir"], "runner.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0), os.dup2(err, 1), os.dup2(err, 2), os.close(null), os.close(err)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    code = 0
    try:
        run_case.main(request["dir"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would: its traceback, exit 1
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


if __name__ == "__main__":
    request = serve(socket.socket(fileno=int(sys.argv[1])))
    os._exit(0 if request is None else runner(request))  # a runner ends without the server's exit handlers
