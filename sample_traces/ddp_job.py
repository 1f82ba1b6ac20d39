"""The data-parallel job of make_samples.py's many-rank cases (cases_ranks.py), launched as

    python -m torch.distributed.run --standalone --nproc-per-node 4 ddp_job.py CASE RUN_DIR

DDP over gloo on the CPU: the ReLU MLP of healthy_mlp on teacher regression, each rank its share
of the data through a real DataLoader (DistributedSampler, num_workers=0), Adam 1e-3, recorded on
every rank (a 1 s heartbeat and flush, so that a hang is written within seconds; else defaults).

ddp_straggler: from step SLOW_FROM, rank SLOW_RANK's batches take SLOW_S longer to load (its
    collate function sleeps: a host busier than the others), 150 steps; the other ranks wait for
    it in the gradient all-reduce.
ddp_hang: at step HANG_STEP rank HANG_RANK's data loading blocks for good (a hung reader); the
    other ranks go on into that step and wait in the gradient all-reduce until gloo's 10 s
    timeout ends the job (they raise, torchrun stops rank HANG_RANK with SIGTERM).
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sample_lib import relu_mlp, teacher_regression  # noqa: E402

from torchautopsy import Recorder  # noqa: E402

SLOW_RANK, SLOW_FROM, SLOW_S = 1, 60, 0.03
HANG_RANK, HANG_STEP = 2, 40
STEPS = {"ddp_straggler": 150, "ddp_hang": 60}


class Collate:
    """Stacks a batch; counts the batches of this rank, to plant the case's fault at its step."""

    def __init__(self, case: str, rank: int):
        self.case, self.rank, self.n = case, rank, 0

    def __call__(self, items):
        step, self.n = self.n, self.n + 1
        if self.case == "ddp_straggler" and self.rank == SLOW_RANK and step >= SLOW_FROM:
            time.sleep(SLOW_S)
        if self.case == "ddp_hang" and self.rank == HANG_RANK and step == HANG_STEP:
            time.sleep(3600)  # the reader hangs
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def main() -> None:
    case, run_dir = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=timedelta(seconds=10 if case == "ddp_hang" else 120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    steps = STEPS[case]
    x, y = teacher_regression(seed=1, n=steps * 64 * world)
    data = TensorDataset(x, y)
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=True, seed=2),
                        collate_fn=Collate(case, rank))
    model = DistributedDataParallel(relu_mlp(seed=0))  # (the same initial weights on every rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Recorder(model, run_dir, heartbeat_s=1.0, flush_every_s=1.0) as rec:
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rec.step(loss=loss)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (gloo's threads can abort the interpreter's teardown, pytorch#190489)


if __name__ == "__main__":
    main()
