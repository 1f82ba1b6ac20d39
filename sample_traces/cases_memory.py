"""The memory cases of make_samples.py: leak_losses_mlp (the loop keeps every step's graph) and
leak_hook_gru (a forward hook keeps every step's GRU outputs), both leaking from step 0, and
oom_pairwise_mlp (a periodic metric asks the CPU allocator for an all-pairs tensor it refuses;
the job dies at step OOM_STEP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cases_common import _train
from sample_lib import GRUClassifier, batches, relu_mlp, teacher_regression, waves
from sample_truth import census, read_trace, rss_growth


# -- memory leaks -----------------------------------------------------------------------------------

def _leak_entry(case: str, run_dir: str, where: list[str], extra: dict) -> dict:
    t = read_trace(run_dir)
    g = rss_growth(t)
    c = census(t)
    print(f"  resident memory {g['rss_mib_first']:.0f} -> {g['rss_mib_last']:.0f} MiB, "
          f"{g['mib_per_step']:.2f} MiB/step (straight-line fit R^2 {g['r2']:.3f}); "
          f"tensor census [step, tensors, with graph, MiB]: {c}")
    if not (g["mib_per_step"] > 1.0 and g["r2"] > 0.95):
        raise SystemExit(f"{case}: memory does not grow steadily ({g})")
    return {"kind": "memory_leak", "step": 0, "where": where, "evidence": {**g, "census": c, **extra}}


def leak_losses_mlp(run_dir: str) -> dict:
    """A ReLU MLP (width 256, batch 512) whose loop keeps every loss tensor for a plot at the end
    (losses.append(loss)) and calls loss.backward(retain_graph=True), a leftover from debugging. Each
    kept loss holds its step's graph and, because of retain_graph, the activations the graph saved
    (~2 MiB per step). Without retain_graph backward frees those and the leak is only the graph's
    nodes (a few KB per step, measured). Adam 1e-3, 200 steps."""
    x, y = teacher_regression(seed=1, n=8192)
    model = relu_mlp(seed=0, width=256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(x), seed=2, batch=512)
    losses = []

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.mse_loss, opt, backward_kwargs={"retain_graph": True},
           after_backward=lambda step, loss: losses.append(loss))
    return _leak_entry("leak_losses_mlp", run_dir, [], {
        "cause": "losses.append(loss) with loss.backward(retain_graph=True)",
        "kept_losses_with_graph": sum(1 for v in losses if v.grad_fn is not None)})


def leak_hook_gru(run_dir: str) -> dict:
    """healthy_gru's model, data and recipe, plus a forward hook on the GRU that collects its output
    sequences for a later look at the hidden states (hidden_states.append(output.detach())) and is
    never removed or cleared: 64 x 50 x 128 float32 = 1.6 MiB kept per step. 200 steps."""
    x, y = waves(4096, seed=31)
    torch.manual_seed(0)
    model = GRUClassifier(128)
    hidden_states = []
    model.gru.register_forward_hook(lambda mod, args, out: hidden_states.append(out[0].detach()))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    b = batches(len(x), seed=32)

    def batch(step):
        idx = next(b)
        return (x[idx],), y[idx]

    _train(model, run_dir, 200, batch, F.cross_entropy, opt, clip=1.0)
    kept = sum(h.numel() * h.element_size() for h in hidden_states) / 2 ** 20
    return _leak_entry("leak_hook_gru", run_dir, ["gru"], {
        "cause": "a forward hook on gru appends output.detach() to a list every step",
        "kept_tensors": len(hidden_states), "kept_mib": round(kept, 1),
        "kept_mib_per_step": round(kept / len(hidden_states), 3)})


# -- running out of memory ----------------------------------------------------------------------------

# Items in the retrieval bank of oom_pairwise_mlp: their all-pairs difference tensor is
# 2**20 x 2**20 x 64 float32 = 256 TiB, which no machine's allocator grants (it is refused at once,
# before any page is touched, so making the sample is safe on a shared machine).
OOM_BANK_ITEMS = 2**20
OOM_STEP = 60


def _pairwise_retrieval(model: nn.Module, bank_inputs: torch.Tensor) -> float:
    """Mean distance to the nearest other item of the bank, in the first layer's feature space,
    written with broadcasting (the bug: fine on the 512-item bank it was tried on)."""
    feats = model.fc1(bank_inputs).detach()
    d = (feats[:, None, :] - feats[None, :, :]).norm(dim=-1)  # items x items x features first
    return float(d.topk(2, largest=False).values[:, 1].mean())


def oom_pairwise_mlp(run_dir: str) -> dict:
    """healthy_mlp's model, data and recipe (Adam 1e-3), plus a retrieval metric every 60 steps
    over a bank of 2**20 inputs. At step 60 the metric asks for a 256 TiB all-pairs tensor: the CPU
    allocator raises, the error leaves the `with Recorder(...)` block and the job ends. The
    recorder keeps the error, where it was raised and a census of live tensors (the largest: the
    bank's 2**20 x 16 inputs and their 2**20 x 64 features)."""
    x, y = teacher_regression(seed=1)
    model = relu_mlp(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    b = batches(len(x), seed=2)
    bank = torch.randn(OOM_BANK_ITEMS, x.shape[1], generator=torch.Generator().manual_seed(3))

    def batch(step):
        if step and step % OOM_STEP == 0:
            _pairwise_retrieval(model, bank)
        idx = next(b)
        return (x[idx],), y[idx]

    try:
        _train(model, run_dir, 200, batch, F.mse_loss, opt)
    except RuntimeError as e:
        if "can't allocate memory" not in str(e):
            raise
        message = str(e).split("DefaultCPUAllocator: ", 1)[-1][:120]
    else:
        raise SystemExit("oom_pairwise_mlp: the pairwise tensor was allocated (no out-of-memory error)")
    t = read_trace(run_dir)
    if len(t["step"]) != OOM_STEP:
        raise SystemExit(f"oom_pairwise_mlp: {len(t['step'])} steps recorded, expected {OOM_STEP}")
    print(f"  out of memory at step {OOM_STEP}: {message}")
    return {"kind": "out_of_memory", "step": OOM_STEP, "where": [], "evidence": {
        "cause": "all-pairs differences over a 2**20-item bank by broadcasting: 2**20 x 2**20 x 64 float32",
        "requested_bytes": OOM_BANK_ITEMS * OOM_BANK_ITEMS * 64 * 4, "error": message}}
