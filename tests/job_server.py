"""The job server of tests/forked_jobs.py, run as ``python -c <this file's text> FD [MODULE ...]``
(as -c, so that the jobs it forks start as ``python -c`` and scripts would: sys.path[0] '', no
__file__ of its own). It imports torch (and the modules it is given), then forks a job for each
request it gets on its socket (SOCK_SEQPACKET: a message of JSON, the job's stdin, stdout and
stderr as file descriptors with it), answers its pid, and tells when each job ends and how. A
subreaper: processes a job leaves behind are its children, and reaped."""

import ctypes, gc, importlib, importlib.machinery, json, os, select, signal, socket, sys, types
import torch  # noqa: F401  (the point: jobs forked from here find it imported)

def serve():
    sock = socket.socket(fileno=int(sys.argv[1]))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    jobs = set()

    def send(msg):
        sock.send(json.dumps(msg).encode())

    def kill_children(also_jobs):
        # SIGKILL this process's children (and their process groups) but its running jobs
        # (unless also_jobs): processes jobs left behind, reparented to it. Returns how many.
        me, killed = str(os.getpid()), 0
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
                pid = int(entry)
                if ppid != me or (pid in jobs and not also_jobs):
                    continue
                group = os.getpgid(pid)
                if group not in jobs or also_jobs:  # (not a running job's group)
                    os.killpg(group, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (OSError, ValueError, IndexError):
                pass
        return killed

    for name in sys.argv[2:]:
        importlib.import_module(name)
    ours = [m for m in sys.modules if m.split(".")[0] in ("torchautopsy", "tests")]
    assert not ours, f"the server imported {ours[:3]}: jobs must import them fresh"
    # Its objects out of the collector's reach: a job's collections and its exit (which frees
    # them all) then write to fewer of the pages it shares with the server (each write a copy
    # of the page): a job's exit measured 1.1 -> 0.3 CPU-s.
    gc.freeze()
    send({"ready": os.getpid()})
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in jobs:
                jobs.discard(pid)
                send({"exited": pid, "status": os.waitstatus_to_exitcode(status)})
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if not data:  # the test process closed its end: every process left, and their children
            while kill_children(also_jobs=True):
                while True:
                    try:
                        os.waitpid(-1, 0)
                    except ChildProcessError:
                        break
            sys.exit(0)
        request, pid = json.loads(data), None
        try:
            if request.get("op") == "orphans":
                send({"killed": kill_children(also_jobs=False)})
                continue
            threads = len(os.listdir("/proc/self/task"))
            if threads != 1:
                raise RuntimeError(f"{threads} threads in the server: a fork copies their locks, held or not")
            pid = os.fork()
            if pid == 0:
                break
            try:
                os.setpgid(pid, pid)  # (the job does it too: whichever runs first)
            except OSError:
                pass
            jobs.add(pid)
            send({"started": pid})
        except Exception as e:
            send({"error": f"{type(e).__name__}: {e}"})
        finally:
            if pid != 0:
                for fd in fds:
                    os.close(fd)
    # The job (the forked process)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r), os.close(wake_w), sock.close()
    return request, fds

def job(request, fds):
    """This process as the fresh interpreter `python ARGV` would be; returns the job's code."""
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    main = types.ModuleType("__main__")
    main.__annotations__ = {}
    if request["path"] is None:  # python -c
        main.__loader__ = importlib.machinery.BuiltinImporter
        filename, source = "<string>", request["code"]
    else:
        filename = os.path.abspath(request["path"])
        sys.path[0] = os.path.dirname(os.path.realpath(filename))
        main.__file__, main.__cached__ = filename, None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", filename)
        with open(filename, "rb") as f:
            source = f.read()
    sys.modules["__main__"] = main
    return compile(source, filename, "exec", dont_inherit=True), main.__dict__

code, namespace = job(*serve())
del serve, job
exec(code, namespace)
