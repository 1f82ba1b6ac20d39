"""The test process's side of tests/hostile/runner_server.py (a script: it imports nothing of
tests/): the server started, a runner forked for each case (a Forked: its status as Popen's)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.fork_server import Forked, ForkServer

SCRIPT = Path(__file__).with_name("runner_server.py")


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

    def start(self, folder, cwd) -> Forked:
        """A runner doing run_case.py's main(folder) in cwd, output to folder/runner.err."""
        request = {"dir": os.fspath(folder), "cwd": os.path.abspath(cwd), "env": self.env}
        self._sock.send(json.dumps(request).encode())
        return Forked(self, self._reply()["started"])

    def alive(self) -> bool:
        return self.proc.poll() is None
