"""A job killed by SIGKILL, and a two-rank torch.distributed job, analyzed through the CLI (in this process).
The jobs are processes forked from an interpreter that imported torch (tests/forked_jobs.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.helpers import REPO, invoke_cli

TRAIN_NAN_THEN_HANG = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from torchautopsy import Recorder

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0
        def forward(self, x):
            self.calls += 1
            return x * float("nan") if self.calls == 31 else x  # NaN born at step 30

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Scale(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = Recorder(model, sys.argv[1], flush_every_s=0.2)
    for step in range(100000):
        x = torch.randn(32, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        rec.step(loss=loss)
        print(step, flush=True)
""")


def test_sigkilled_job_is_analyzed(jobs, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_NAN_THEN_HANG)
    run_dir = tmp_path / "run"
    p = jobs.popen([sys.executable, str(script), str(run_dir)], stdout=subprocess.PIPE, text=True)
    t0, last = None, -1
    while last < 60 or time.time() - t0 < 1.0:  # well past the NaN, and five flushes after it
        line = p.stdout.readline()
        assert line, "training subprocess died"
        last = int(line)
        t0 = t0 or time.time()  # from the first step: importing torch takes a while
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL

    out = tmp_path / "f.json"
    r = invoke_cli("analyze", run_dir, "--json", out)
    assert r.returncode == 0, r.stderr
    assert "did not close its trace" in r.stdout
    (nf,) = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "nonfinite"]
    assert nf["step"] == 30 and nf["where"] == ["2"], nf
    info = invoke_cli("info", run_dir)
    assert info.returncode == 0 and "not closed" in info.stdout


DDP_TRAIN = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch import nn
    from torchautopsy import Recorder

    class Blowup(nn.Module):
        # On rank 1 only, the batch of step 20 makes this module divide by zero.
        def __init__(self):
            super().__init__()
            self.calls = 0
        def forward(self, x):
            self.calls += 1
            bad = dist.get_rank() == 1 and self.calls == 21
            return x / (0.0 if bad else 1.0)

    def main(rank, world, run_dir):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), Blowup(), nn.ReLU(), nn.Linear(16, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        with Recorder(model, run_dir) as rec:
            g = torch.Generator().manual_seed(rank)
            for step in range(30):
                loss = ddp(torch.randn(16, 8, generator=g)).pow(2).mean()
                opt.zero_grad(); loss.backward(); opt.step()
                rec.step(loss=loss)
        dist.destroy_process_group()

    if __name__ == "__main__":  # (forked: the ranks do not import torch again, ~3 CPU-s each)
        torch.multiprocessing.start_processes(main, args=(2, sys.argv[1]), nprocs=2, start_method="fork")
""")


def test_two_ranks_name_the_rank_that_went_wrong_first(jobs, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ddp.py"
    script.write_text(DDP_TRAIN)
    run_dir = tmp_path / "run"
    r = jobs.run([sys.executable, str(script), str(run_dir), str(port)], capture_output=True,
                 text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(run_dir)) == ["rank0.h5", "rank1.h5"]

    out = tmp_path / "f.json"
    res = invoke_cli("analyze", run_dir, "--json", out)
    assert res.returncode == 0, res.stderr
    nf = [f for f in json.loads(out.read_text())["findings"] if f["kind"] == "nonfinite"]
    by_rank = {f["rank"]: f for f in nf}
    # Rank 1's forward produced the Inf/NaN at step 20; the all-reduce carried it to rank 0's
    # gradients in the same step.
    assert by_rank[1]["step"] == 20 and by_rank[1]["where"] == ["1"], by_rank[1]
    assert by_rank[1]["evidence"]["stage"] == "forward"
    assert by_rank[0]["step"] == 20 and by_rank[0]["evidence"]["stage"] in ("backward", "optimizer")
    assert nf[0]["rank"] == 1  # listed first: it went wrong first
    assert "rank 1 went wrong first" in res.stdout
    info = invoke_cli("info", run_dir)
    assert "rank 1 of 2" in info.stdout
