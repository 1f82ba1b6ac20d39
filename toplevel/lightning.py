"""``Trainer(callbacks=[TorchAutopsyCallback("runs/exp1")])`` for ``lightning`` (imports it)."""

from .recorder.integrations.lightning import LightningCallback as TorchAutopsyCallback

__all__ = ["TorchAutopsyCallback"]
