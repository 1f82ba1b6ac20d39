"""Fuzzing-case runners forked from one interpreter that imported the analyzer once.

A fresh `python tests/hostile/run_case.py DIR` paid the interpreter's start and the analyzer's
import (~0.9 CPU-s; ~1.5 with the reports, matplotlib and fpdf2) before a case's first command:
that was most of a case's CPU. ``RunnerServer`` starts this file as a script, which imports
PRELOAD (never torch: the CLI runs without it, and the server checks it is not imported), then
forks a runner per case, which does exactly what run_case.py's main does in a fresh process:

- the runner is a process group of its own (pid == pgid), stdin /dev/null, stdout and stderr the
  case's ``runner.err``, working directory the case's, environment run_cli.ENV (what the fresh
  runner got; the server's differs at most in OMP_NUM_THREADS, see RunnerServer);
- ``Runner.poll()``/``wait()`` give its status as Popen's returncode (negative: the signal that
  ended it), so run_cli watches it (VmHWM from /proc, killpg past KILL_RSS or the time limit)
  and reports a death as before;
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
import subprocess
import sys
import tempfile
import time

# What a case's commands import: the CLI, load()'s package, the reports (HTML, PDF, Markdown,
# terminal) and what they draw with. Measured on a case with HTML and PDF: everything it
# imports that the CLI's import does not is under these.
PRELOAD = ("torchautopsy", "torchautopsy.analyzer.cli", "torchautopsy.analyzer.restarts",
           "torchautopsy.reports.build", "torchautopsy.reports.html", "torchautopsy.reports.pdf",
           "torchautopsy.reports.markdown", "torchautopsy.reports.terminal",
           "matplotlib.backends.backend_agg", "fpdf", "jinja2", "PIL.Image")


class Runner:
    """A forked runner, as much of Popen as run_cli uses: pid, returncode, poll(), wait()."""

    def __init__(self, server: "RunnerServer", pid: int):
        self._server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._status(self.pid, 0)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._server._status(self.pid, None)
        return self.returncode


class RunnerServer:
    def __init__(self, env: dict, timeout: float = 120):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        self.env = env
        # One thread to fork from: numpy's OpenBLAS starts a pool at import unless told (the suite
        # sets OMP_NUM_THREADS=1 anyway; `python -m tests.hostile.campaign` may not). The runner
        # gets ``env`` itself back, so the commands see what a fresh runner's would.
        server_env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], env=server_env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
                                     pass_fds=[theirs.fileno()], start_new_session=True)
        theirs.close()
        self._exits: dict[int, int] = {}
        self._running: set[int] = set()
        self._reply(timeout)
        self._log.seek(0)
        said = self._log.read().decode(errors="replace")
        if said.strip():
            self.close()
            raise RuntimeError(f"the runner server's imports wrote to stderr:\n{said[-3000:]}")

    def _message(self, timeout: float | None) -> dict | None:
        if not select.select([self._sock], [], [], timeout)[0]:
            return None
        data = self._sock.recv(1 << 16)
        if not data:
            self._log.seek(0)
            raise RuntimeError(f"the runner server died ({self.proc.poll()}): "
                               + self._log.read().decode(errors="replace")[-3000:])
        msg = json.loads(data)
        if "exited" in msg:
            self._exits[msg["exited"]] = msg["status"]
            self._running.discard(msg["exited"])
        elif "error" in msg:
            raise RuntimeError(f"runner server: {msg['error']}")
        return msg

    def _reply(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            msg = self._message(max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise TimeoutError(f"no answer from the runner server in {timeout} s")
            if "exited" not in msg:
                return msg

    def _status(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self._exits:
            if self._message(None if deadline is None else max(0.0, deadline - time.monotonic())) is None:
                return None
        return self._exits.pop(pid)  # (asked once: a pid may be reused by a later runner)

    def start(self, folder, cwd) -> Runner:
        """A runner doing run_case.py's main(folder) in cwd, output to folder/runner.err."""
        request = {"dir": os.fspath(folder), "cwd": os.path.abspath(cwd), "env": self.env}
        self._sock.send(json.dumps(request).encode())
        pid = self._reply()["started"]
        self._running.add(pid)
        return Runner(self, pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        for pid in self._running:
            _kill_group(pid)
        self._sock.close()  # the server kills what is left and exits
        try:
            self.proc.wait(timeout=30)
        finally:
            _kill_group(self.proc.pid)
            self.proc.wait()  # reaped: its CPU, and its runners', counts in this process's
            self._log.close()


def _kill_group(pgid: int) -> None:
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
                _kill_group(pid)
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
