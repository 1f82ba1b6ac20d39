"""The test process's side of tests/hostile/runner_server.py (a script: it imports nothing of
tests/): the server started, a runner forked for each case, their statuses as Popen's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.fork_server import ForkServer

SCRIPT = Path(__file__).with_name("runner_server.py")


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


class RunnerServer(ForkServer):
    kind = "runner server"

    def __init__(self, env: dict, timeout: float = 120):
        self.env = env
        # One thread to fork from: numpy's OpenBLAS starts a pool at import unless told (the suite
        # sets OMP_NUM_THREADS=1 anyway; `python -m tests.hostile.campaign` may not). The runner
        # gets ``env`` itself back, so the commands see what a fresh runner's would.
        server_env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}
        super().__init__(lambda fd: [sys.executable, str(SCRIPT), str(fd)], server_env, timeout=timeout)
        said = self._said()
        if said.strip():
            self.close()
            raise RuntimeError(f"the runner server's imports wrote to stderr:\n{said[-3000:]}")

    def start(self, folder, cwd) -> Runner:
        """A runner doing run_case.py's main(folder) in cwd, output to folder/runner.err."""
        request = {"dir": os.fspath(folder), "cwd": os.path.abspath(cwd), "env": self.env}
        self._sock.send(json.dumps(request).encode())
        return Runner(self, self._reply()["started"])

    def alive(self) -> bool:
        return self.proc.poll() is None
