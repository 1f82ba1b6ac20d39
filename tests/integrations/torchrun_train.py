"""Trained by tests/integrations/test_torchrun.py under `torchrun --nproc-per-node 2` (gloo, CPU).

argv: root, then jobs MODE:RECORDING trained one after the other in this one torchrun job, each
from scratch (its own seed, model, optimizer, Recorder): a rank costs ~4.5 CPU-s before its first
step (torch's import, and DDP's of torch._dynamo), a job's own training well under 1. MODE: ddp |
fsdp; RECORDING: the ranks that record ("0,1", "1", or "none"). A NaN is planted in rank 1's
batch of step BAD. Each job writes root/MODE_RECORDING/run (commas dropped: ddp_01, fsdp_1,
ddp_none) and, per rank, out.json.rank{N} there: its losses, and (fsdp) the whole parameters'
gradient and weight norms, gathered here by the test's own collectives (both ranks call them,
in the same order, whether they record or not)."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchautopsy import Recorder

STEPS, BAD = 10, 6
root, jobs = sys.argv[1], sys.argv[2:]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
for job in jobs:
    mode, recording = job.split(":")
    run_dir = f"{root}/{mode}_{recording.replace(',', '')}"
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    names = [n for n, _ in model.named_parameters()]
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)
    # Step BAD is not watched (0 and 5 are): its NaN is found without a replay of the forward.
    recorded = str(rank) in recording.split(",")
    rec = Recorder(trained, f"{run_dir}/run", activations_every=5) if recorded else None
    losses, grad_norms, param_norms = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        if rank == 1 and step == BAD:
            x[0, 0] = float("nan")
        loss = F.cross_entropy(trained(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mode == "fsdp":
            with torch.no_grad():
                grad_norms.append([float(p.grad.full_tensor().norm()) for p in model.parameters()])
                param_norms.append([float(p.full_tensor().norm()) for p in model.parameters()])
        if rec is not None:
            rec.step(loss=loss)
        losses.append(float(loss.detach()))
    if rec is not None:
        rec.close()
    with open(f"{run_dir}/out.json.rank{rank}", "w") as f:
        json.dump({"names": names, "losses": losses, "grad_norm": grad_norms, "param_norm": param_norms}, f)
    dist.barrier()
dist.destroy_process_group()
# Skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an active
# exception", pytorch#190489), after everything above is written; the test reads the files instead.
sys.stdout.flush()
os._exit(0)
