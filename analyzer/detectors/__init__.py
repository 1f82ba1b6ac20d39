"""The detector registry: an explicit tuple. Each detector module has KIND, REQUIRES and
``detect(rank_trace, cfg) -> list[Finding]``, a pure function over a read-only trace."""

from . import exploding_gradients, nonfinite, vanishing_gradients

DETECTORS = (nonfinite, exploding_gradients, vanishing_gradients)
