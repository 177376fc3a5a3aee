"""Which tensors live on the simulated device, and what the host pays for touching them (docs/DESIGN.md 4.17).

``DeviceTracker`` is a ``TorchFunctionMode`` the simulated device enters around every scheduler step. It sees
every torch call and keeps a weak registry of the tensors it has classified:
- host tensors: made by a factory without a ``device=`` (the project's convention for host tensors; from numpy
  arrays ``torch.as_tensor``, since ``torch.from_numpy`` is invisible to a torch function mode), by a copy to the
  host, or by an op over host tensors alone;
- device tensors: made with a ``device=``, by a copy to the device, by an op over any device tensor, and every
  tensor the tracker has not seen made (weights, the KV cache, the slot table: allocated before a step).

Each call is then charged as a GPU host would pay it:
- a host read of a device tensor (``tolist``, ``item``, ``bool()``, ``int()``, ``__index__``, ``cpu()``,
  ``numpy()``, a copy to the host, formatting), an op whose output shape depends on a device tensor's values
  (``nonzero``, ``masked_select``, boolean-mask indexing or assignment, ``unique``, ``repeat_interleave`` without
  ``output_size``, one-argument ``where``, ``bincount`` without ``minlength``, ...) or a blocking host-to-device
  copy (``torch.tensor(data, device=...)``, ``.to(device)`` without ``non_blocking``, a host tensor mixed into a
  device op) is a sync: the host blocks until the modelled device is done and pays the round trip
  (``DeviceClock.sync``), recorded with its op and our calling line;
- any other op over a device tensor is an eager kernel launch: its CPU seconds are refunded and the machine's
  launch cost charged (``DeviceClock.launch_kernel``); views and metadata cost neither;
- ops over host tensors are host work at their real cost.
The tracker's own bookkeeping is refunded. ``modelled()`` suspends the tracker for a synthetic forward's
internals: they stand for the forward whose launches ``DeviceClock.launch`` charged; its outputs are device
tensors and its CPU seconds are refunded.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ddtree_serve.sim.device_clock import DeviceClock, SyncEvent

_T = torch.Tensor
_HOST, _DEVICE = False, True
_READS = {_T.tolist, _T.item, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.cpu, _T.numpy, _T.__array__,
          _T.__format__, _T.__repr__, _T.__str__, torch.equal, torch.allclose, torch.is_nonzero}
_SHAPES = {torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.masked_select, _T.masked_select,
           torch.unique, _T.unique, torch.unique_consecutive, _T.unique_consecutive}
_REPEATS = {torch.repeat_interleave, _T.repeat_interleave}
_VIEWS = {_T.view, _T.view_as, _T.reshape, _T.reshape_as, _T.unsqueeze, _T.squeeze, _T.expand, _T.expand_as,
          _T.permute, _T.transpose, _T.t, _T.narrow, _T.select, _T.split, _T.chunk, _T.unbind, _T.flatten,
          _T.unflatten, _T.detach, _T.size, _T.dim, _T.numel, _T.stride, _T.is_contiguous, _T.data_ptr,
          _T.element_size, _T.__len__, _T.contiguous, torch.unbind, torch.split, torch.chunk, torch.flatten,
          torch.reshape, torch.squeeze, torch.unsqueeze, torch.transpose, torch.permute, torch.narrow, torch.select,
          _T.__iter__, _T.untyped_storage}
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.empty_strided}
_COPIES_IN = {torch.tensor, torch.as_tensor}  # host data to the device
_HERE = __file__


def _caller() -> str:
    """file:line of the nearest frame outside torch and this file."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == _HERE or "/torch/" in f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?"
    name = f.f_code.co_filename
    cut = name.rfind("ddtree_serve/")
    return f"{name[cut:] if cut >= 0 else name}:{f.f_lineno}"


def _op_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _is_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class DeviceTracker(TorchFunctionMode):
    """See the module docstring. One per simulated device (``clock``); re-entered every step."""

    def __init__(self, clock: DeviceClock) -> None:
        super().__init__()
        self.clock = clock
        self.where: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> _HOST / _DEVICE
        self._suspended = 0
        self._graphed = 0  # inside graph_region: launches are the replay's

    def on_device(self, t: torch.Tensor) -> bool:
        return self.where.get(t, _DEVICE)

    @property
    def in_graph_region(self) -> bool:
        """Whether ops run inside ``graph_region`` now (a simulated forward there is part of one replay)."""
        return self._graphed > 0

    def _mark(self, out: Any, device: bool) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.where[t] = device

    @contextmanager
    def modelled(self) -> Iterator[None]:
        """A synthetic forward's internals: not tracked, outputs on the device, CPU seconds refunded."""
        self._suspended += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._suspended -= 1
            self.clock.refund(time.perf_counter() - t0)

    @contextmanager
    def kernel_region(self) -> Iterator[None]:
        """A torch reference that stands for one CUDA kernel (``ddtree_serve.kernels.dispatch.one_kernel``): one
        launch, no syncs, outputs on the device, CPU seconds refunded."""
        with self.modelled():
            yield
        self.clock.launch_kernel()

    @contextmanager
    def graph_region(self) -> Iterator[None]:
        """Ops a GPU runs as one CUDA graph replay (``ddtree_serve.kernels.dispatch.graph_replay``): tracked as
        usual, but their launches are not charged and the region's host time, Python included, becomes one
        replay's; a sync inside raises (a CUDA graph capture fails on one)."""
        t0, offset0, launches0 = time.perf_counter(), self.clock.offset, self.clock.counters.launches
        self._graphed += 1
        try:
            yield
        finally:
            self._graphed -= 1
        spent = (time.perf_counter() - t0) + (self.clock.offset - offset0)  # the region's host seconds so far
        self.clock.refund(spent)
        self.clock.counters.launches = launches0
        self.clock.replay_graph()

    def record_event(self) -> SimEvent:
        """A CUDA event's stand-in (``kernels.dispatch.record_event``): the end of the device work queued so far."""
        return SimEvent(self, self.clock.busy_until)

    def _sync(self, kind: str, func: Any) -> float:
        """Charge a sync; returns the host seconds it blocked (not bookkeeping: they stay on the clock)."""
        if self._graphed:
            raise RuntimeError(f"a host sync ({kind} {_op_name(func)} at {_caller()}) inside a CUDA graph region")
        t0 = time.perf_counter()
        self.clock.sync(SyncEvent(kind, _op_name(func), _caller(), self.clock.window_open))
        return time.perf_counter() - t0

    def _target(self, value: Any, src: bool) -> bool:
        """Where ``.to(value)`` puts a tensor whose source is on the device (``src``): the string ``"cpu"`` is the
        host (the project's copies to the host are ``.cpu()``, ``.tolist()``, ``.numpy()`` or ``.to("cpu")``); a
        ``torch.device`` is the device (on the simulator the runner's device is a ``cpu`` device object); a
        tensor is wherever it lives; a dtype alone keeps the side."""
        if isinstance(value, torch.Tensor):
            return self.on_device(value)
        if isinstance(value, str):
            return _HOST if value == "cpu" else _DEVICE
        if isinstance(value, torch.device):
            return _DEVICE
        return src

    def _classify(self, func: Any, args: tuple, kwargs: dict) -> tuple[str | None, bool]:
        """(the sync this call is, or None; whether its outputs live on the device)."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dev_in = any(self.on_device(t) for t in tensors)
        host_in = any(not self.on_device(t) and t.dim() > 0 for t in tensors)
        non_blocking = bool(kwargs.get("non_blocking", False))
        if func in (_T.to, _T.cuda):
            src = self.on_device(args[0])
            dst = _DEVICE if func is _T.cuda else src
            for a in (*args[1:2], kwargs.get("device")):
                if a is not None:
                    dst = self._target(a, src)
            if dst != src and not non_blocking:
                return ("h2d" if dst else "read"), dst
            return None, dst
        if func in _READS:
            return ("read" if dev_in else None), _HOST
        if func in _FACTORIES:
            dev = kwargs.get("device")
            on = dev is not None and not (isinstance(dev, str) and dev == "cpu")
            if func in _COPIES_IN and on:
                data = args[0] if args else kwargs.get("data")
                return (None if isinstance(data, torch.Tensor) and self.on_device(data) else "h2d"), _DEVICE
            return None, on
        if func is _T.copy_:
            dst, src = self.on_device(args[0]), self.on_device(args[1])
            return (None if dst == src or non_blocking else "h2d" if dst else "read"), dst
        if not dev_in:
            return None, _HOST
        if func in _SHAPES or (func in (torch.where, _T.where) and len(args) + len(kwargs) == 1):
            return "shape", _DEVICE
        if func in _REPEATS and kwargs.get("output_size") is None and isinstance((args[1:2] or (None,))[0],
                                                                                 torch.Tensor):
            return "shape", _DEVICE
        if func in (torch.bincount, _T.bincount) and kwargs.get("minlength") is None:
            return "shape", _DEVICE
        if func in (_T.__getitem__, _T.__setitem__) and _is_bool_index(args[1]):
            return "shape", _DEVICE
        if host_in:  # a host tensor fed to a device op: an implicit blocking copy (most ops refuse it on CUDA)
            return ("h2d" if func is _T.__setitem__ else "mixed"), _DEVICE
        return None, _DEVICE

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if self._suspended:
            out = func(*args, **kwargs)
            if func not in _READS:
                self._mark(out, _DEVICE)
            return out
        t_in = time.perf_counter()
        kind, on = self._classify(func, args, kwargs)
        blocked = self._sync(kind, func) if kind is not None else 0.0
        t_run = time.perf_counter()
        out = func(*args, **kwargs)
        t_done = time.perf_counter()
        launched = on and func not in _VIEWS and not (func is _T.__getitem__ and not self._gathers(args[1]))
        self._mark(out, on)
        # bookkeeping is not host work; a device op's own CPU time becomes a launch
        self.clock.refund((t_run - t_in - blocked) + (time.perf_counter() - t_done)
                          + ((t_done - t_run) if launched else 0.0))
        if launched and not self._graphed:
            self.clock.launch_kernel()
        return out

    @staticmethod
    def _gathers(index: Any) -> bool:
        """Whether an index reads by tensor (a gather kernel) rather than by slicing (a view)."""
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, (torch.Tensor, list)) for i in items)


class SimEvent:
    """A recorded point of the simulated device's queue. ``synchronize`` is one synchronising read: the host blocks
    until the work queued before the point is done (not what was launched after it) and pays a round trip. It is
    never counted in a forward's window: work launched after the event, a forward included, is not waited for."""

    def __init__(self, tracker: DeviceTracker, until: float) -> None:
        self.tracker, self.until = tracker, until

    def synchronize(self) -> None:
        """Wait for the recorded point (see the class docstring)."""
        if self.tracker._graphed:
            raise RuntimeError(f"an event wait at {_caller()} inside a CUDA graph region")
        clock = self.tracker.clock
        clock.sync(SyncEvent("read", "Event.synchronize", _caller(), False), self.until)
