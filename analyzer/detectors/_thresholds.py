"""The bounds check every detector's thresholds run when a config is made (analyze --config)."""

from __future__ import annotations


def check_bounds(cfg, **bounds) -> None:
    """ValueError naming the field when a threshold lies outside [lo, hi] (None: unbounded)."""
    for name, (lo, hi) in bounds.items():
        v = getattr(cfg, name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            want = (f">= {lo}" if hi is None else f"between {lo} and {hi}")
            raise ValueError(f"{name} must be {want}, got {v!r}")
