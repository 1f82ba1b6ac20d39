"""What only all ranks together tell: the rank that stopped first (hang), the slow rank
(straggler), the replica that left the others (replica_divergence). Each detector here is a
small pure function over the ranks' digests (digest.py), which the per-rank pass computes where
it reads each rank (analyzer/parallel.py); merge.py makes the ranks' own findings one per event.

Each module has the members of analyzer/detectors/' modules (KIND, CONFIG, ORDER, Evidence) and
``detect(digests, cfg, trace) -> list[Finding]`` (``trace``: the run's headers, for a few rows read
by name)."""

from __future__ import annotations

from . import divergence, hang, straggler

CROSS_DETECTORS = (hang, straggler, divergence)
