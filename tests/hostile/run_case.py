"""Run a fuzzing case's commands one after another in this one process (tests/hostile/run_cli.py
forks it from runner_server.py, which calls main() as this script would, and checks the
contract): each CLI command through the real entry point ``torchautopsy.analyzer.cli.main``
(its exit code is its SystemExit), and ``python -c CODE ARGS`` (the load() driver) as CODE
executed with ``sys.argv`` set. Importing the analyzer costs a fresh interpreter 1.5-2 CPU-s; a
case of six commands pays it once here instead of six times, and a runner forked from the server
not at all.

    python tests/hostile/run_case.py DIR

DIR holds ``spec.json`` (a list of {"label", "argv"}); for command i this writes ``i.out`` and
``i.err`` (file descriptors 1 and 2, so what native code writes, HDF5's error stack say, is caught
too) and appends to ``DIR/status`` a line "start i" before starting it and, after it,
"done i RC WALL_S PEAK_RSS_BYTES". If this process dies (a signal, a native crash, a kill for
time or memory), the last "start" line names the command in flight.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
import traceback
import warnings

CLI_MODULE = "torchautopsy.analyzer.cli"


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux 4.0+), so that the next read is this
    command's own peak; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss(resettable: bool) -> int:
    """Peak RSS in bytes since the last reset; without the reset, the process's peak so far
    (ru_maxrss: an earlier, bigger command's peak then shows on later ones too: errs high, never low)."""
    if resettable:
        try:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration, ValueError):
            pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def give_back_memory() -> None:
    """Free what the last command left, so the next command's peak starts near this runner's own."""
    gc.collect()
    try:  # glibc keeps freed small blocks mapped; hand them back to the kernel
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def execute(argv: list[str]) -> int:
    """Run one command as its own process would and return its exit code (1 and a traceback on
    stderr for an uncaught exception, as the interpreter does)."""
    try:
        if argv[1:3] == ["-m", CLI_MODULE]:
            from torchautopsy.analyzer.cli import main
            sys.argv = [CLI_MODULE, *argv[3:]]
            main(argv[3:])
        elif argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own driver
        else:
            raise SystemExit(f"run_case: not a command it can run in process: {argv[:3]}")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("text"): the interpreter prints it and exits 1
        return 1
    except BaseException as e:  # noqa: BLE001 - what would have escaped a process: its traceback, exit 1
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the command's frame, not ours
        return 1
    return 0


def main(folder: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # run as a script: not a module dir
    with open(os.path.join(folder, "spec.json")) as f:
        spec = json.load(f)
    status = open(os.path.join(folder, "status"), "a", buffering=1)
    saved = os.dup(1), os.dup(2)
    for i, cmd in enumerate(spec):
        give_back_memory()
        resettable = reset_peak()
        status.write(f"start {i}\n")  # before the command: a death from here on is this command's
        sys.stdout.flush()
        sys.stderr.flush()
        with open(os.path.join(folder, f"{i}.out"), "wb") as out, open(os.path.join(folder, f"{i}.err"), "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            t0 = time.monotonic()
            try:
                # A warning shows once per place in a process; entering catch_warnings forgets
                # which were shown, so each command's stderr holds what its own process would.
                warnings.onceregistry.clear()
                with warnings.catch_warnings():
                    rc = execute(cmd["argv"])
            finally:
                wall = time.monotonic() - t0
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except (OSError, ValueError):
                        pass
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        status.write(f"done {i} {rc} {wall:.3f} {peak_rss(resettable)}\n")
    status.close()


if __name__ == "__main__":
    main(sys.argv[1])
