"""Detector thresholds: named, with their defaults and where each default comes from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExplodingGradientsConfig:
    # Early baseline: median total gradient norm over the first finite steps of the run
    # (10% of the run, at least 5 and at most 50 steps).
    baseline_min_steps: int = 5
    baseline_max_steps: int = 50
    # Sustained: the trailing median over `window` steps exceeds the baseline this many times.
    # Two orders of magnitude: on our healthy sample traces the total gradient norm stays within
    # ~10x of its early median (measured; see README's table), while a learning rate too high
    # passes 100x within a few steps of the divergence (Pascanu et al. 2013 describe the blow-up).
    sustained_ratio: float = 100.0
    window: int = 5
    # A single-step jump this many times the baseline, not sustained, is reported as a warning.
    spike_ratio: float = 1000.0


@dataclass(frozen=True)
class VanishingGradientsConfig:
    # Ratio of the gradient RMS of the earliest weight matrices to that of the last ones. Below
    # 1e-3 (three orders of magnitude) the early layers effectively stop learning; healthy sample
    # traces (MLP/ReLU) stay above 1e-1 (measured), a 12-layer sigmoid MLP falls below 1e-5
    # (Glorot & Bengio 2010 measured the same decay through sigmoid layers).
    ratio: float = 1e-3
    # Absolute floor: an early-layer weight gradient RMS below this is "near zero" in float32.
    near_zero_rms: float = 1e-10
    # Judged over the last quarter of the run (at least `min_window` steps) so a slow start
    # does not count; the onset is where the trailing median of the ratio first falls below.
    window_frac: float = 0.25
    min_window: int = 5
    onset_window: int = 5


@dataclass(frozen=True)
class NonfiniteConfig:
    pass


@dataclass(frozen=True)
class AnalysisConfig:
    exploding_gradients: ExplodingGradientsConfig = field(default_factory=ExplodingGradientsConfig)
    vanishing_gradients: VanishingGradientsConfig = field(default_factory=VanishingGradientsConfig)
    nonfinite: NonfiniteConfig = field(default_factory=NonfiniteConfig)
