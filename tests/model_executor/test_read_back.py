"""read_back: several per-request tensors of different dtypes and shapes come back exactly, in one copy (one sync
under the simulated device's tracker)."""

from __future__ import annotations

import numpy as np
import torch

from ddtree_serve.model_executor.read_back import read_back
from ddtree_serve.sim.device_clock import DeviceClock
from ddtree_serve.sim.device_tracker import DeviceTracker
from ddtree_serve.sim.machines import DeviceCostModel


def test_read_back_is_exact_and_one_sync() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 7], dtype=torch.int32)  # [bs]
    tokens = torch.randint(-5, 163_840, (3, 9), generator=g)  # [bs, S] int64
    reach = torch.rand(3, 5, generator=g, dtype=torch.float32)  # [bs, D]
    reach[0, 1] = float("nan")
    reach[1, 2] = float("-inf")
    logws = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)  # [bs, 2, 4]
    flags = torch.rand(3, 6, generator=g) > 0.5  # [bs, 6] bool
    clock = DeviceClock(DeviceCostModel())
    with DeviceTracker(clock):
        dev = [t.to(torch.device("cpu")) for t in (lengths, tokens, reach, logws, flags)]  # copies to the device
        clock.reset_counters()
        out = read_back(*dev)
    assert len(clock.counters.syncs) == 1 and clock.counters.syncs[0].kind == "read"
    for got, want in zip(out, (lengths, tokens, reach, logws, flags), strict=True):
        ref = want.numpy()
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert np.array_equal(got, ref, equal_nan=ref.dtype.kind == "f")
    assert read_back() == []


def test_read_later_is_exact_and_waits_only_for_the_work_before_it() -> None:
    """``read_later``'s copy is queued without a sync; its ``wait`` is one read that blocks until the device work
    queued before it is done, not the forward launched after it, and is never counted in that forward's window."""
    import time

    from ddtree_serve.model_executor.read_back import read_later

    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 0, 7])  # [bs]
    reach = torch.rand(3, 5, generator=g, dtype=torch.float32)  # [bs, D]
    flags = torch.rand(3, 6, generator=g) > 0.5  # [bs, 6]
    clock = DeviceClock(DeviceCostModel())
    with DeviceTracker(clock):
        dev = [t.to(torch.device("cpu")) for t in (lengths, reach, flags)]
        clock.launch(0.02, kernels=1, graphed=True)  # the step's forward: 20 ms of device work
        clock.reset_counters()
        pending = read_later(*dev)
        assert not clock.counters.syncs  # the copy is queued, not waited for
        clock.launch(0.2, kernels=1, graphed=True)  # the next forward, launched before the wait
        t0 = time.perf_counter()
        out = pending.wait()
        waited = time.perf_counter() - t0
    assert 0.01 <= waited < 0.1  # until the first forward's end, not the second's
    assert len(clock.counters.syncs) == 1 and not clock.counters.syncs[0].in_window
    for got, want in zip(out, (lengths, reach, flags), strict=True):
        assert got.dtype == want.numpy().dtype and np.array_equal(got, want.numpy())
