"""Trained by tests/integrations/test_torchrun_ranks.py under `torchrun --nproc-per-node 3` (gloo,
CPU): failures that only a job of several ranks has, each planted on one rank.

argv: root, scenarios (comma-separated). The job runs the scenarios one after the other, each
from scratch (its own seed, model, optimizer, DataLoader and Recorder, writing root/SCENARIO/run):
a rank costs ~4.5 CPU-s before its first step (torch's import, and DDP's of torch._dynamo), a
scenario's own training well under 1, so one job serves every scenario that ends normally. Every
rank records (heartbeat every HEARTBEAT_S, flushed as often, replica fingerprints on every step)
and trains a small MLP under DDP, with AdamW, on batches from a real DataLoader (num_workers=0)
over a synthetic dataset split by a DistributedSampler.

- straggler (3 ranks): from step SLOW on, rank 2's collate_fn sleeps SLOW_S: its loader is slow,
  the others wait for it in the gradient all-reduce (their backward grows).
- divergence (3 ranks): after the optimizer step of step DIVERGE, rank 1 adds 1e-3 to one weight
  of PERTURBED: a silent replica divergence (DDP never broadcasts the parameters again).
- hang (3 ranks): at step HANG, rank 1 stops before its forward (the line marked `# HANG`); the
  others go into step HANG and wait in the gradient all-reduce of loss.backward() (`# BACKWARD`)
  until gloo's timeout (TIMEOUT_S, the timeout of the hang's own process group) raises there; they
  die, and torchrun then stops rank 1 (so the last scenario of a job).
- nan (3 ranks): a NaN in rank 1's batch of step BAD, put there by its collate_fn.
- backward_nan (3 ranks): at step BAD, rank 2's loss gains a distance to an anchor taken at the
  weights themselves: sqrt(0) is 0 in the forward (every loss stays finite) and 0/0 in the
  backward. Only rank 2's own gradients are NaN; after the all-reduce every rank's are.
- backward_nan_fsdp (3 ranks): the same under FSDP2 (each Linear and the model fully_shard'ed),
  the distance taken from the model's output to itself detached; after the reduce-scatter every
  rank's shard is NaN.

Each rank that finishes a scenario writes root/SCENARIO/out.rank{N} (JSON: its losses and parameter names)."""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from torchautopsy import Recorder

BATCH = 16
STEPS = {"straggler": 20, "divergence": 12, "hang": 10, "nan": 10, "backward_nan": 10, "backward_nan_fsdp": 10}
SLOW, SLOW_S = 8, 0.15  # straggler: rank 2, from this step on, this much longer in its loader
DIVERGE, PERTURBED = 6, "module.2.weight"  # divergence: rank 1, after this step's optimizer step
HANG, TIMEOUT_S = 5, 8  # hang: rank 1 stops before this step's forward; the collectives' timeout
BAD = 6  # nan: rank 1's batch of this step holds a NaN
HEARTBEAT_S = 0.5

root, scenarios = sys.argv[1], sys.argv[2].split(",")
# The hang's job is ended as a real one is: by the collectives' timeout, TIMEOUT_S on the process
# group of its DDP. The default group's timeout (the other scenarios', the barriers') is only there
# so that no mistake can leave a job waiting for long; a short one could end a sound scenario on a
# loaded machine.
assert "hang" not in scenarios[:-1], "the hang ends the job: it can only be the last scenario"
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


class Synthetic(Dataset):
    """x: 8 features, y: one of 4 classes, the same in every run."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1234)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Collate:
    """Stacks a batch; counts the batches made, and so knows the step that will train on it."""

    def __init__(self, scenario: str):
        self.scenario, self.step = scenario, -1

    def __call__(self, items):
        self.step += 1
        x = torch.stack([item[0] for item in items])
        y = torch.stack([item[1] for item in items])
        if self.scenario == "straggler" and rank == 2 and self.step >= SLOW:
            time.sleep(SLOW_S)  # SLOW_LOADER
        if self.scenario == "nan" and rank == 1 and self.step == BAD:
            x[0, 0] = float("nan")
        return x, y


# At the module's level, not in a function: the hang's stack is checked to end in <module>.
for scenario in scenarios:
    steps = STEPS[scenario]
    torch.manual_seed(0)
    data = Synthetic(world * steps * BATCH)
    loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False),
                        collate_fn=Collate(scenario), num_workers=0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    if scenario.endswith("_fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    elif scenario == "hang":
        ddp = DistributedDataParallel(model, process_group=dist.new_group(timeout=timedelta(seconds=TIMEOUT_S)))
    else:
        ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    # nan: activations_every=5, the NaN's step (6) is not watched, steps 0 and 5 are (as torchrun_train.py).
    # The others keep the default (steps 0 and 10 watched: a watched step's forward is slower).
    rec = Recorder(ddp, f"{root}/{scenario}/run", heartbeat_s=HEARTBEAT_S, flush_every_s=HEARTBEAT_S,
                   stall_factor=2, fingerprint_every=1, activations_every=5 if scenario == "nan" else 10)
    losses = []
    for step, (x, y) in enumerate(loader):
        if scenario == "hang" and rank == 1 and step == HANG:
            time.sleep(3600)  # HANG
        logits = ddp(x)
        loss = F.cross_entropy(logits, y)
        if scenario == "backward_nan_fsdp" and rank == 2 and step == BAD:
            loss = loss + 1e-3 * torch.sqrt(((logits - logits.detach()) ** 2).sum())  # BACKWARD_NAN_FSDP
        if scenario == "backward_nan" and rank == 2 and step == BAD:
            w = model[0].weight
            loss = loss + 1e-3 * torch.sqrt(((w - w.detach()) ** 2).sum())  # BACKWARD_NAN
        opt.zero_grad()
        loss.backward()  # BACKWARD
        opt.step()
        if scenario == "divergence" and rank == 1 and step == DIVERGE:
            with torch.no_grad():
                model[2].weight[0, 0] += 1e-3
        rec.step(loss=loss)
        losses.append(float(loss.detach()))
    rec.close()
    with open(f"{root}/{scenario}/out.rank{rank}", "w") as f:
        json.dump({"names": [n for n, _ in ddp.named_parameters()], "losses": losses}, f)
    dist.barrier()
dist.destroy_process_group()
# Skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an active
# exception", pytorch#190489), after everything above is written; the test reads the files instead.
sys.stdout.flush()
os._exit(0)
