"""The analysis's thresholds: one config per finding kind, each owned by its detector (its
module's ``CONFIG``, a frozen dataclass whose fields are the thresholds, with their defaults and
where each default comes from). ``AnalysisConfig`` holds one of each, by kind; ``analyze --config
FILE.toml`` overrides them, one table per kind (config_file.py)."""

from __future__ import annotations

from dataclasses import field, make_dataclass

from .cross_rank import CROSS_DETECTORS
from .detectors import DETECTORS

_ALL = (*DETECTORS, *CROSS_DETECTORS)
AnalysisConfig = make_dataclass(
    "AnalysisConfig", [(d.KIND, d.CONFIG, field(default_factory=d.CONFIG)) for d in _ALL], frozen=True)
AnalysisConfig.__module__ = __name__
AnalysisConfig.__doc__ = "Every detector's thresholds, one field per finding kind."

# Each kind's config class by its own name (UpdateRatioConfig, ...), as code that builds one imports it.
globals().update({d.CONFIG.__name__: d.CONFIG for d in _ALL})
__all__ = ["AnalysisConfig", *(d.CONFIG.__name__ for d in _ALL)]
