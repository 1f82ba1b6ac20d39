"""Recorder overhead on GPU-sized models (needs a CUDA GPU): bare and recorded, in one process.

    python benchmarks/gpu_models.py                     # both models, 2 repetitions
    python benchmarks/gpu_models.py --models mlp-4096 --repeats 3 --steps 300

overhead.py's workloads are CPU-sized: on a GPU they are launch-bound (a 2-9 ms step of tiny
kernels, the GPU mostly idle), so every microsecond of host work counts in full. These two keep
an H100 busy:

- ``mlp-4096``: 8 x (Linear 4096->4096 + ReLU), batch 4096, float32, AdamW (~68 ms a step);
- ``transformer-1024``: ``nn.TransformerEncoder``, 12 layers, d_model 1024, 16 heads, sequence
  512, batch 16, vocabulary 32,000, bfloat16 autocast, fused AdamW (~43 ms a step).

Each repetition trains the model bare, then recorded (``Recorder(model, dir)``, the defaults):
``--warmup`` steps (default 110: past the recorder's own 100-step warm-up), then ``--steps``
timed ones, each ending with the loss on the host (the bare loop's ``loss.item()``, the recorder's
``rec.step(loss=loss)``). It prints each run's mean and median step and its slowest steps (the
watched steps show there), and the best mean against the best mean.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch import nn

MODELS = ("mlp-4096", "transformer-1024")


def build(name: str, dev: torch.device):
    """model, optimizer, loss function, batches (on dev), autocast dtype or None."""
    g = torch.Generator().manual_seed(0)
    if name == "mlp-4096":
        layers = []
        for _ in range(8):
            layers += [nn.Linear(4096, 4096), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(4096, 10)).to(dev)
        batches = [(torch.randn(4096, 4096, generator=g), torch.randint(0, 10, (4096,), generator=g))
                   for _ in range(4)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss_fn, amp = nn.CrossEntropyLoss(), None
    elif name == "transformer-1024":
        d, n_layers, seq, batch, vocab = 1024, 12, 512, 16, 32000

        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, d)
                layer = nn.TransformerEncoderLayer(d, 16, 4 * d, dropout=0.1, batch_first=True)
                self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
                self.head = nn.Linear(d, vocab)

            def forward(self, tokens):
                return self.head(self.encoder(self.embed(tokens)))

        model = Encoder().to(dev)
        batches = []
        for _ in range(4):
            tokens = torch.randint(0, vocab, (batch, seq), generator=g)
            batches.append((tokens, torch.roll(tokens, -1, dims=1)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ce = nn.CrossEntropyLoss()

        def loss_fn(out, y):
            return ce(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        amp = torch.bfloat16
    else:
        raise ValueError(f"unknown model {name!r}")
    return model, opt, loss_fn, [(x.to(dev), y.to(dev)) for x, y in batches], amp


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run(name: str, recorded: bool, steps: int, warmup: int, dev: torch.device) -> tuple[float, float, list]:
    """(mean ms, median ms, [(step, ms)] slowest 8) of the timed steps."""
    from torchautopsy import Recorder

    torch.manual_seed(0)
    model, opt, loss_fn, batches, amp = build(name, dev)
    with tempfile.TemporaryDirectory(prefix="torchautopsy-gpu-") as tmp:
        rec = Recorder(model, tmp) if recorded else None

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, amp or torch.float32, enabled=amp is not None):
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if rec is not None:
                rec.step(loss=loss)
            else:
                loss.item()

        for i in range(warmup):
            step(i)
        sync(dev)
        per = []
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            t = time.perf_counter()
            step(i)  # (ends with the loss on the host: the GPU's work is done)
            per.append((i, (time.perf_counter() - t) * 1e3))
        sync(dev)
        mean = (time.perf_counter() - t0) / steps * 1e3
        if rec is not None:
            rec.close()
    del model, opt, batches
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    ms = sorted(v for _, v in per)
    return mean, ms[len(ms) // 2], sorted(per, key=lambda p: -p[1])[:8]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--steps", type=int, default=400, help="timed steps per run (default 400)")
    ap.add_argument("--warmup", type=int, default=110, help="steps before them (default 110)")
    ap.add_argument("--repeats", type=int, default=2, help="bare/recorded pairs per model (default 2)")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to smoke-test this script")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"unknown model {', '.join(bad)} (choose from {', '.join(MODELS)})")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (overhead.py measures the CPU workloads)")
    print(f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}, torch {torch.__version__}; {args.warmup} warm-up steps, "
          f"{args.steps} timed, {args.repeats} repetitions", flush=True)
    for name in models:
        best = {}
        for rep in range(args.repeats):
            for recorded in (False, True):
                mean, median, slow = run(name, recorded, args.steps, args.warmup, dev)
                label = "recorder" if recorded else "bare"
                best[label] = min(best.get(label, mean), mean)
                print(f"  {name} {label:8} mean {mean:7.2f} ms, median {median:7.2f} ms; slowest steps "
                      + ", ".join(f"{s}: {v:.0f}" for s, v in slow), flush=True)
        print(f"{name}: best mean {best['recorder']:.2f} against {best['bare']:.2f} ms a step, "
              f"{best['recorder'] / best['bare']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
