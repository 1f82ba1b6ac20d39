"""``Trainer(..., callbacks=[TorchAutopsyCallback("runs/exp1")])`` for transformers (imports it)."""

from .recorder.integrations.huggingface import TorchAutopsyCallback

__all__ = ["TorchAutopsyCallback"]
