"""Shared test helpers: run the real CLI as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_traces"


def run_cli(*args, block_torch: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    """`torchautopsy ARGS...` in a fresh interpreter; with block_torch, `import torch` fails."""
    prelude = "import sys\n"
    if block_torch:
        prelude += "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
    code = prelude + "from torchautopsy.analyzer.cli import main\nmain(sys.argv[1:])\n"
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def rank_copies(run, n_ranks: int, sample: str = "healthy_mlp"):
    """``run`` made a run directory of ``n_ranks`` copies of a sample's rank file, each with its
    own rank and the world size in its attributes (the reader checks them against the name)."""
    import shutil

    import h5py

    run.mkdir()
    for r in range(n_ranks):
        shutil.copy(SAMPLES / sample / "rank0.h5", run / f"rank{r}.h5")
        with h5py.File(run / f"rank{r}.h5", "r+") as f:
            f.attrs["rank"], f.attrs["world_size"] = r, n_ranks
    return run
