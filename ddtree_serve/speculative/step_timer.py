"""Host time per phase of the speculative step (benchmarks/bench_spec.py and bench_scale.py read
``SpecWorker.timer``), with the seconds the host spent blocked on the device kept out of its phases
(``device_wait``). Times are the runner's host clock: wall time, or a simulated device's corrected clock
(ddtree_serve/sim/device_clock.py: launches and round trips charged, device work the CPU ran refunded)."""

from __future__ import annotations

from collections import defaultdict
from typing import Protocol


class HostClock(Protocol):
    """What the timer needs of a ModelRunner (ddtree_serve/model_executor/model_runner.py)."""

    def host_now(self) -> float: ...

    def blocked_seconds(self) -> float: ...


class StepTimer:
    """Accumulates host seconds per phase of the speculative step (for benchmarks); what the host spent blocked
    on the device during a phase goes to ``device_wait``, not to the phase."""

    def __init__(self, clock: HostClock) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._clock = clock
        self._t = 0.0
        self._b = clock.blocked_seconds()

    def start(self) -> None:
        self._t = self._clock.host_now()
        self._b = self._clock.blocked_seconds()

    def now(self) -> float:
        return self._clock.host_now()

    def lap(self, phase: str) -> float:
        """Close the current phase; returns its host seconds."""
        now, b = self._clock.host_now(), self._clock.blocked_seconds()
        blocked = b - self._b
        dt = now - self._t - blocked
        self.totals["device_wait"] += blocked
        self.totals[phase] += dt
        self._t, self._b = now, b
        return dt
