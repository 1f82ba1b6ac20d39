"""The test process's side of a fork server: a child interpreter that imported once what the
processes it forks need, then forks one on each request (tests/job_server.py for recorded jobs,
tests/forked_jobs.py; tests/hostile/runner_server.py for the fuzzing's case runners).

One SOCK_SEQPACKET socket between them, a JSON message a packet: the server says {"ready": pid}
once, answers each request ({"started": pid}, or {"error": why}) and tells when each process it
forked ends ({"exited": pid, "status": returncode as Popen's}). The server is this process's child
(reaped at close: its CPU time, and its forks', counts in this process's)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
from typing import Callable


class Forked:
    """A process the server forked, as much of Popen as every user needs: pid, args, returncode,
    poll(), wait(timeout) (subprocess.TimeoutExpired past it)."""

    def __init__(self, server: "ForkServer", pid: int, args=None):
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server._status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class ForkServer:
    kind = "fork server"  # (as its errors name it)

    def __init__(self, argv: Callable[[int], list[str]], env: dict, cwd: str | None = None, timeout: float = 120):
        """Start ``argv(fd)`` (fd: the server's end of the socket), its stderr kept for errors."""
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv(theirs.fileno()), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._log, env=env, cwd=cwd, pass_fds=[theirs.fileno()],
                                     start_new_session=True)
        theirs.close()
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._reply(timeout)

    def _said(self) -> str:
        """What the server wrote to stderr so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def _message(self, timeout: float | None) -> dict | None:
        """The server's next message (a process's end is noted), or None past ``timeout``."""
        if not select.select([self._sock], [], [], timeout)[0]:
            return None
        data = self._sock.recv(1 << 16)
        if not data:
            raise RuntimeError(f"the {self.kind} died ({self.proc.poll()}): {self._said()[-3000:]}")
        msg = json.loads(data)
        if "exited" in msg:
            self._exits[msg["exited"]] = msg["status"]
        elif "started" in msg:
            self._exits.pop(msg["started"], None)  # (a pid that ended before may be this one's now)
            self._started.append(msg["started"])
        elif "error" in msg:
            raise RuntimeError(f"{self.kind}: {msg['error']}")
        return msg

    def _reply(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            msg = self._message(max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise TimeoutError(f"no answer from the {self.kind} in {timeout} s")
            if "exited" not in msg:
                return msg

    def _status(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s returncode once it ended, or None past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self._exits:
            if self._message(None if deadline is None else max(0.0, deadline - time.monotonic())) is None:
                return None
        return self._exits[pid]

    def close(self) -> None:
        """The server and every process it started, their groups included, SIGKILLed if left."""
        for pid in self._started:
            if pid not in self._exits:  # (a pid known to have ended may be another's now)
                kill_group(pid)
        self._sock.close()  # (the server kills what is left and exits)
        try:
            self.proc.wait(timeout=30)
        finally:
            kill_group(self.proc.pid)
            self.proc.wait()
            self._log.close()


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
