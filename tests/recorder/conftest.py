"""Recorder tests: tiny models, where torch's intra-op threads only add contention on a small
shared machine. One thread keeps the whole recorder test set fast and its timings steady."""

import torch

torch.set_num_threads(1)
