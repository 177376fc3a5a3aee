"""Wall time per phase of the speculative step (benchmarks/bench_spec.py reads ``SpecWorker.timer``)."""

from __future__ import annotations

import time
from collections import defaultdict


class StepTimer:
    """Accumulates wall time per phase of the speculative step (for benchmarks)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> float:
        """Close the current phase; returns its seconds."""
        now = time.perf_counter()
        dt = now - self._t
        self.totals[phase] += dt
        self._t = now
        return dt
