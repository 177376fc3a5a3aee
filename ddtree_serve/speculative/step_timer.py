"""Wall time per phase of the speculative step (benchmarks/bench_spec.py and bench_scale.py read
``SpecWorker.timer``), with the step's two kinds of device time kept out of its phases: ``device_wait`` (the host
blocked on the device) and ``device_ops`` (tensor work that is device work in deployment)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class DeviceSync(Protocol):
    """What the timer needs of a ModelRunner (ddtree_serve/model_executor/model_runner.py)."""

    def wait_device(self) -> None: ...

    def on_device(self) -> AbstractContextManager: ...


class StepTimer:
    """Accumulates wall time per phase of the speculative step (for benchmarks). ``booked``: a counter of seconds
    that are device work run by the CPU (``ModelRunner.booked_device_seconds``); what it gains during a phase
    goes to ``device_ops``, not to the phase."""

    def __init__(self, booked: Callable[[], float] | None = None) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._t = 0.0
        self._booked = booked
        self._b = booked() if booked is not None else 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> float:
        """Close the current phase; returns its seconds."""
        now = time.perf_counter()
        dt = now - self._t
        if self._booked is not None:
            b = self._booked()
            self.totals["device_ops"] += b - self._b
            dt -= b - self._b
            self._b = b
        self.totals[phase] += dt
        self._t = now
        return dt

    def wait(self, runner: DeviceSync, phase: str) -> None:
        """Close ``phase`` (its host work and launches), then block until the device is done: a simulated
        device's modelled time (ddtree_serve/sim/) is the ``device_wait`` lap; a real device waits in its reads."""
        self.lap(phase)
        runner.wait_device()
        self.lap("device_wait")

    @contextmanager
    def device_ops(self, runner: DeviceSync, phase: str) -> Iterator[None]:
        """Run the enclosed tensor work as device work (``ModelRunner.on_device``: a simulated device books its CPU
        seconds, which ``lap`` moves to ``device_ops``); on a real device its host cost stays in ``phase``."""
        with runner.on_device():
            yield
        self.lap(phase)
