"""torchautopsy: a flight recorder for PyTorch training, and the autopsy that reads it.

    from torchautopsy import Recorder      # in the training job (needs torch)
    from torchautopsy import load          # offline, on a laptop (needs no torch)

Both names are imported lazily so that a training job importing ``Recorder`` never pulls in
pandas or matplotlib, and a laptop importing ``load`` never needs torch.
"""

__version__ = "0.1.0"
__all__ = ["Recorder", "load", "__version__"]


def __getattr__(name):
    if name == "Recorder":
        from .recorder import Recorder

        return Recorder
    if name == "load":
        from .analyzer.trace import load

        return load
    raise AttributeError(f"module 'torchautopsy' has no attribute {name!r}")
