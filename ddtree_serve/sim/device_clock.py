"""A simulated accelerator's timeline and the host's, kept honest (docs/DESIGN.md 4.17).

As with CUDA's asynchronous launches, ``launch`` queues modelled device seconds and returns at once; the device
works through its queue in the background (``busy_until``). The host's clock is wall time corrected by what the
simulator knows a GPU host would have spent instead: ``charge`` adds host seconds the CPU did not spend (a kernel
launch, a graph replay, a synchronising round trip), ``refund`` removes CPU seconds that are device work on a GPU
(a tensor op run here on device-resident tensors, a synthetic forward). Every time is read from ``now()``, so a
wait (``sync``) blocks exactly until the modelled device is done on the corrected clock: CPU-run device work
hides nothing behind a forward that is still in flight. The tracker (``device_tracker.py``) calls ``sync`` at
every host read of a device tensor and ``launch_kernel`` at every eager device op. The cost of a forward is the
machine model's (``ddtree_serve/sim/machines.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ddtree_serve.sim.machines import DeviceCostModel


@dataclass
class SyncEvent:
    """One synchronising act of the host: what it was, where in our code, and whether a forward was in flight."""

    kind: str  # "read" (device -> host), "shape" (a value-dependent shape), "h2d" (a blocking copy), "mixed"
    op: str  # the torch function
    where: str  # file:line of our caller
    in_window: bool  # between a forward's launch and its read-back point: the overlap window closed early


@dataclass
class StepCounters:
    """What the host did to the device since the last ``reset``."""

    syncs: list[SyncEvent] = field(default_factory=list)
    launches: int = 0  # eager kernels (a forward's own count included) and graph replays
    forwards: int = 0
    eager_forwards: int = 0  # forwards launched kernel by kernel (no graph)
    target_forwards: int = 0

    @property
    def in_window(self) -> int:
        return sum(e.in_window for e in self.syncs)


class DeviceClock:
    """The device's timeline and the host's corrected clock (see the module docstring)."""

    def __init__(self, cost: DeviceCostModel) -> None:
        self.cost = cost
        self.offset = 0.0  # host seconds charged less CPU seconds refunded
        self.busy_until = 0.0  # host-clock time the queued device work ends
        self.window_open = False  # a forward was launched and its read-back point (``close_window``) not reached
        self.device_s = 0.0  # modelled device seconds launched so far
        self.waited_s = 0.0  # host seconds spent blocked on the device
        self.refunded_s = 0.0  # CPU seconds run as device work
        self.launches = 0  # modelled forwards launched
        self.counters = StepCounters()

    def now(self) -> float:
        """The host's clock: wall time plus charges, less refunds."""
        return time.perf_counter() + self.offset

    def charge(self, seconds: float) -> None:
        """Host seconds a GPU host spends that the CPU did not (launch costs, round trips)."""
        self.offset += seconds

    def refund(self, seconds: float) -> None:
        """CPU seconds that ran device work: not host time."""
        self.offset -= seconds
        self.refunded_s += seconds

    def launch(self, seconds: float, kernels: int, graphed: bool, target: bool = True) -> None:
        """Queue a forward of ``seconds`` device time behind what is queued; the host pays its launches: one
        graph replay, or ``kernels`` eager launches. ``target``: the target's forward (else the drafter's)."""
        self.charge(self.cost.graph_launch_us * 1e-6 if graphed else kernels * self.cost.launch_us * 1e-6)
        self.counters.launches += 1 if graphed else kernels
        self.counters.forwards += 1
        self.counters.eager_forwards += not graphed
        self.counters.target_forwards += target
        self.busy_until = max(self.busy_until, self.now()) + seconds
        self.window_open = True
        self.device_s += seconds
        self.launches += 1

    def launch_kernel(self) -> None:
        """One eager device op: the host pays a launch; its device time is inside the forwards' modelled cost."""
        self.charge(self.cost.launch_us * 1e-6)
        self.counters.launches += 1

    def replay_graph(self) -> None:
        """One replay of a captured graph of device ops (not a forward): the host pays one graph launch."""
        self.charge(self.cost.graph_launch_us * 1e-6)
        self.counters.launches += 1

    def close_window(self) -> None:
        """The step reached a forward's read-back point (``ModelRunner.wait_device``): syncs from here on are
        where the step means to read."""
        self.window_open = False

    def wait(self, until: float | None = None) -> None:
        """Block the host until the queued device work is done (``until``: the end of the work queued by then)."""
        left = (self.busy_until if until is None else until) - self.now()
        if left > 0:
            t0 = time.perf_counter()
            time.sleep(left)
            self.waited_s += time.perf_counter() - t0

    def sync(self, event: SyncEvent, until: float | None = None) -> None:
        """A synchronising host act: wait for the device (``until``: only for the work queued before that time on
        the host's clock, an event's), then pay the round trip."""
        self.counters.syncs.append(event)
        self.wait(until)
        self.charge(self.cost.sync_us * 1e-6)

    def reset_counters(self) -> StepCounters:
        """The counters since the last reset; starts new ones."""
        out, self.counters = self.counters, StepCounters()
        return out
