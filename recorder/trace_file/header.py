"""What a trace says of itself before its first step: the root attributes (format, versions,
host, rank, model, config, command) and the static tables (parameters, modules, histogram bins
and which tensors get histograms), as docs/trace_format.md describes them."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import sys
import time

import torch

from ... import __version__  # the package's one version string (toplevel/__init__.py)
from ..distributed import sharding
from ..memory.readings import RSS_SOURCE
from ..reductions.histograms import bin_edges
from .module_sources import module_sources
from .schema import FORMAT_NAME, SCHEMA_VERSION

_MAX_SUMMARY_CHARS = 65536
# PyTorch's NCCL flight recorder (its ring buffer of collectives, dumped on a timeout): the
# settings it reads from the environment. A trace keeps them so that the report can say where
# the job's dumps went (the analyzer never opens them: they are pickles).
NCCL_FLIGHT_RECORDER_ENV = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
                            "TORCH_NCCL_TRACE_CPP_STACK", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_ENABLE_MONITORING")


def trace_header(model, param_names: list[str], params: list, watcher, config, rank: int, world_size: int,
                 device, hist_params: list[int], hist_modules: list[int]) -> tuple[dict, dict]:
    """(root attributes, static tables {group: {name: (values, dtype)}}) of a new trace."""
    now = time.time()
    class_source, forward_source = module_sources(watcher.modules)
    attrs = {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "created_by": f"torchautopsy {__version__}",
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world_size,
        "start_time": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(timespec="seconds"),
        "start_unix": now,
        "device": str(device),
        # how steps/rss_bytes was read here (memory/readings.py): "statm" is Linux's
        "rss_source": RSS_SOURCE,
        "model_class": type(model).__name__,
        "model_summary": str(model)[:_MAX_SUMMARY_CHARS],
        "n_parameters": int(sum(p.numel() for p in params)),
        "config": json.dumps(config.as_dict(), sort_keys=True),
        "command": " ".join(sys.argv)[:4096],
        "nccl_env": json.dumps({k: os.environ[k][:512] for k in NCCL_FLIGHT_RECORDER_ENV if k in os.environ}),
        "closed": False,
    }
    static = {  # name: (values, dtype)
        "params": {
            "name": (param_names, "str"),
            "shape": ([json.dumps(list(p.shape)) for p in params], "str"),
            "numel": ([int(p.numel()) for p in params], "i8"),
            "dtype": ([str(p.dtype).replace("torch.", "") for p in params], "str"),
            # >1: a sharded (FSDP2) parameter, measured by this rank's shard (distributed/sharding.py)
            "shards": ([sharding.shards(p) for p in params], "i8"),
            # 1 if the parameter required gradients when the Recorder started (0: frozen)
            "requires_grad": ([int(p.requires_grad) for p in params], "i8"),
        },
        "modules": {
            "name": (watcher.names, "str"),
            "type": (watcher.types, "str"),
            "is_leaf": ([int(x) for x in watcher.is_leaf], "i8"),
            # Where the module's code is ("path:line", module_sources.py): its class, its forward.
            "class_source": (class_source, "str"),
            "forward_source": (forward_source, "str"),
        },
    }
    lower, upper = bin_edges()
    static["histogram_bins"] = {"lower": (lower, "f8"), "upper": (upper, "f8")}
    static["histogram_params"] = {"param": (hist_params, "i8")}
    static["histogram_modules"] = {"module": (hist_modules, "i8")}
    return attrs, static
