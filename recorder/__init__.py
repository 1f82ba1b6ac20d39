"""The in-training half of torchautopsy. Imports only torch, h5py, numpy and the stdlib."""

from .config import RecorderConfig
from .recorder import Recorder

__all__ = ["Recorder", "RecorderConfig"]
