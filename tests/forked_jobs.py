"""Recorded training jobs in processes forked from one interpreter that imported torch once.

A fresh `python` pays ~2.5-3 CPU-s for torch's import before a job's first step; most tests that
run a job in a process of its own test what the job does and how it ends (its exit status, a
signal, its exit handlers, its output), not the interpreter's start. ``job_server`` (one a pytest
process: each xdist worker its own) is an interpreter that imported torch, and never torchautopsy
nor any test module, whose only work is to fork; ``jobs.popen([sys.executable, SCRIPT, *args])``
or ``jobs.popen([sys.executable, "-c", CODE, *args])`` (and ``jobs.run``) start a job as
subprocess.Popen (subprocess.run) would, in a process forked from it:

- the job's code runs at its module's level, as ``__main__`` (a module of its own, with
  ``__file__`` for a script), with sys.argv, sys.path[0] (the script's folder, '' for -c), the
  working directory and the environment (os.environ and the C library's) a fresh interpreter
  started that way would have; stdin, stdout and stderr are the file descriptors given (PIPE,
  DEVNULL, STDOUT, a file or a descriptor; stdin /dev/null when not given: never the test
  process's, which is xdist's channel);
- it ends as that interpreter would: its uncaught error (traceback on stderr, sys.last_value set,
  status 1), SystemExit, a signal, or the end of its code, then its exit handlers (atexit) and the
  interpreter's finalization, all in the job's own process. ``Job.wait()`` returns its status as
  Popen's returncode (negative: the signal that ended it);
- it is a process group of its own, and the server a subreaper: the test's ``jobs`` fixture
  SIGKILLs at the test's end each job still running (a failed test's), with its group, and
  whatever processes ended jobs left behind (the server's children now); the server's close
  every process left.

What is not a fresh interpreter's, and so stays with subprocess: torch's import itself and
anything done at interpreter start (`python -m`, import-time checks, sys.flags, an interpreter
where torch cannot be imported), and environment variables read when the interpreter starts or
torch is imported (the server's environment is the test process's: popen() refuses a job whose
environment differs from it in such a variable, STARTUP_ENV). One traceback line more than a
fresh interpreter prints: the server's own line that runs the job's code.

The server has one thread when it forks (torch's import starts none with OMP_NUM_THREADS=1, which
the suite sets; it runs no torch op): it checks, and refuses to fork otherwise. Its objects are
frozen out of the collector (gc.freeze()): a job's exit (finalization, which frees them all)
writes to fewer of the pages it shares with the server, each write a page copied.

A job costs ~0.3 CPU-s more than its own work (the fork, the pages it copies, its exit); a fresh
interpreter ~4 CPU-s (torch's import and finalization). The server costs one torch import a
pytest process, started when a test first asks for it."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fork_server import Forked, ForkServer, kill_group

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Environment variables that the interpreter, the C library, OpenMP or MKL read when the process
# starts or torch is imported: a job whose environment differs from the server's in one needs a
# fresh interpreter. torch's own (TORCH*, PYTORCH*) too where the test sets them for the job;
# torch sets some in the test process as it runs (TORCHINDUCTOR_CACHE_DIR), which a job inherits
# as a fresh one would, and reads them when used, not imported. (TORCHAUTOPSY_*: the recorder's,
# imported in the job.)
STARTUP_ENV = ("PYTHON", "LD_", "OMP_", "GOMP", "KMP_", "MKL", "OPENBLAS", "CUDA", "MALLOC", "GLIBC")
TORCH_ENV = ("TORCH", "PYTORCH")

# The server (tests/job_server.py), run with -c: see its docstring.
SERVER = (Path(__file__).parent / "job_server.py").read_text()


class Job(Forked):
    """A job forked by the server: Popen's pid, args, stdin, stdout, stderr, returncode, poll(),
    wait(timeout), communicate(input, timeout), send_signal(), terminate(), kill()."""

    def __init__(self, server: "JobServer", pid: int, args, stdin, stdout, stderr):
        super().__init__(server, pid, args)
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr

    def communicate(self, input=None, timeout: float | None = None):
        """As Popen's: ``input`` to stdin (then closed), stdout and stderr read to their end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        got = {}

        def read(name, stream):
            got[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=read, args=(name, stream), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream is not None]
        for t in readers:
            t.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return got.get("out"), got.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stream_end(how, default_fd: int, reading: bool, opened: list):
    """(the descriptor the job gets, ours of a pipe or None) for Popen's stdin/stdout/stderr=how."""
    if how is None and default_fd >= 0:
        return default_fd, None
    if how is None or how == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDONLY if reading else os.O_WRONLY)
        opened.append(fd)
        return fd, None
    if how == subprocess.PIPE:
        r, w = os.pipe()
        theirs, ours = (r, w) if reading else (w, r)
        opened.append(theirs)
        return theirs, ours
    return (how if isinstance(how, int) else how.fileno()), None


def run(popen, args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """subprocess.run's, with popen() for subprocess.Popen: past ``timeout`` the job is killed."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    job = popen(args, **kwargs)
    try:
        out, err = job.communicate(input, timeout)
    except subprocess.TimeoutExpired:
        kill_group(job.pid)
        job.wait()
        raise
    if check and job.returncode:
        raise subprocess.CalledProcessError(job.returncode, args, out, err)
    return subprocess.CompletedProcess(args, job.returncode, out, err)


class JobServer(ForkServer):
    """The interpreter that forks the jobs (``preload``: modules it imports after torch)."""

    kind = "job server"

    def __init__(self, preload: tuple[str, ...] = (), timeout: float = 300):
        self.env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        super().__init__(lambda fd: [sys.executable, "-c", SERVER, str(fd), *preload], self.env, REPO, timeout)

    # -- jobs -------------------------------------------------------------------------------------
    def popen(self, args, *, stdin=None, stdout=None, stderr=None, cwd=None, env=None, text=False) -> Job:
        """``args``: [sys.executable, SCRIPT, *argv] or [sys.executable, "-c", CODE, *argv]."""
        args = [os.fspath(a) for a in args]
        if args[0] != sys.executable or len(args) < 2 or (args[1].startswith("-") and args[1] != "-c"):
            raise ValueError(f"not `python SCRIPT ...` nor `python -c CODE ...`: {args[:2]}")
        cwd = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
        env = dict(os.environ if env is None else env)
        differ = sorted({k for k in set(env) | set(self.env) if k.startswith(STARTUP_ENV) and env.get(k) != self.env.get(k)}
                        | {k for k in set(env) | set(os.environ) if k.startswith(TORCH_ENV)
                           and not k.startswith("TORCHAUTOPSY") and env.get(k) != os.environ.get(k)})
        if differ:
            raise ValueError(f"{differ} differ from the job server's: read when torch is imported, "
                             "this job needs a fresh interpreter")
        if args[1] == "-c":
            request = {"path": None, "code": args[2], "argv": ["-c", *args[3:]]}
        else:
            request = {"path": os.path.join(cwd, args[1]), "argv": args[1:]}
        request.update(op="start", cwd=cwd, env=env)
        opened: list[int] = []
        try:
            fd0, w0 = _stream_end(stdin, -1, True, opened)  # (not the test process's stdin)
            fd1, r1 = _stream_end(stdout, 1, False, opened)
            fd2, r2 = (fd1, None) if stderr == subprocess.STDOUT else _stream_end(stderr, 2, False, opened)
            socket.send_fds(self._sock, [json.dumps(request).encode()], [fd0, fd1, fd2])
            pid = self._reply()["started"]
        finally:
            for fd in opened:
                os.close(fd)

        def wrap(fd, mode):
            if fd is None:
                return None
            f = io.open(fd, mode + "b")
            return io.TextIOWrapper(f, write_through=mode == "w") if text else f

        return Job(self, pid, args, wrap(w0, "w"), wrap(r1, "r"), wrap(r2, "r"))

    def run(self, args, **kwargs) -> subprocess.CompletedProcess:
        return run(self.popen, args, **kwargs)

    def kill_orphans(self) -> int:
        """SIGKILL what finished jobs left behind (their children: the server's now)."""
        self._sock.send(json.dumps({"op": "orphans"}).encode())
        return self._reply()["killed"]

class Jobs:
    """A test's view of the server: jobs it starts are SIGKILLed, with their process groups, at
    the test's end (a job a failed test left running, what a killed job left behind)."""

    def __init__(self, server: JobServer):
        self.server, self.started = server, []

    def popen(self, args, **kwargs) -> Job:
        job = self.server.popen(args, **kwargs)
        self.started.append(job)
        return job

    def run(self, args, **kwargs) -> subprocess.CompletedProcess:
        return run(self.popen, args, **kwargs)

    def close(self) -> None:
        for job in self.started:
            if job.poll() is None:  # (a pid known to have ended may be another's now)
                kill_group(job.pid)
                job.wait(60)
            for stream in (job.stdin, job.stdout, job.stderr):
                if stream is not None:
                    stream.close()
        if self.started:
            self.server.kill_orphans()


# What a job with an optimizer imports anyway, at its first optimizer (torch.optim's
# _disable_dynamo wrapper imports torch._dynamo: ~2.7 CPU-s a job when it was not preloaded).
PRELOAD = ("torch._dynamo",)


@pytest.fixture(scope="session")
def job_server():
    """This pytest process's server (tests/conftest.py registers the fixtures: one a session)."""
    server = JobServer(preload=PRELOAD)
    yield server
    server.close()


@pytest.fixture
def jobs(job_server):
    j = Jobs(job_server)
    yield j
    j.close()
