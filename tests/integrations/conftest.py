"""Integration tests: tiny models on CPU, where torch's intra-op threads only add contention on a
small shared machine (as tests/recorder/conftest.py)."""

import torch

torch.set_num_threads(1)
