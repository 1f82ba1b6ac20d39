"""``Trainer(callbacks=[TorchAutopsyCallback("runs/exp1")])`` for ``pytorch_lightning`` (imports it)."""

from .recorder.integrations.lightning import PytorchLightningCallback as TorchAutopsyCallback

__all__ = ["TorchAutopsyCallback"]
