"""The step's read of device results as one named act (docs/DESIGN.md 4.17): several per-request tensors packed
into one buffer and copied to the host once, so a step synchronises once for all of them (the accepted paths,
their tokens, the controller's reach) instead of once per tensor. ``read_later`` starts that copy without waiting
(into pinned memory, fenced by an event) so the host can queue more device work, the next step's draft, before it
waits for the results: the wait then blocks only until the copy is done, not until the work queued after it."""

from __future__ import annotations

import math

import numpy as np
import torch

from ddtree_serve.kernels.dispatch import record_event


def read_back(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Host copies of ``tensors`` (each ``[bs, ...]``, integer, boolean or floating) with one device-to-host copy:
    every tensor's rows as 64-bit words (floats widened to float64 exactly, then their bits) side by side in one
    ``[bs, W]`` buffer, unpacked to arrays of the original dtypes and shapes."""
    if not tensors:
        return []
    return _unpack(_layout(tensors), _pack(tensors).cpu().numpy())  # [bs, W]: the one read


class PendingRead:
    """``read_back``'s copy in flight (``read_later``): ``wait()`` blocks until it has landed and unpacks it."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._layout = _layout(tensors)  # shapes and dtypes, on the host
        packed = _pack(tensors)  # [bs, W] on the device
        pinned = packed.device.type == "cuda"
        self._host = torch.empty(tuple(packed.size()), dtype=torch.int64, pin_memory=pinned)  # [bs, W] host
        self._host.copy_(packed, non_blocking=True)  # queued on the stream like a kernel
        self._event = record_event(packed.device)

    def wait(self) -> list[np.ndarray]:
        """The tensors' host copies (``read_back``'s), once the copy is done: the step's one synchronising read."""
        self._event.synchronize()
        return _unpack(self._layout, self._host.numpy())


def read_later(*tensors: torch.Tensor) -> PendingRead:
    """Start ``read_back``'s one copy of ``tensors`` (each ``[bs, ...]``) and return at once (module docstring)."""
    return PendingRead(tensors)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
          torch.uint8: np.uint8, torch.bool: np.bool_, torch.float64: np.float64, torch.float32: np.float32,
          torch.float16: np.float16}  # the dtypes a read may hold


def _layout(tensors: tuple[torch.Tensor, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor's shape and dtype as host values (no device op)."""
    return [(tuple(t.size()), t.dtype) for t in tensors]


def _pack(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[bs, W] int64: every tensor's rows as 64-bit words (floats as float64 bits), side by side."""
    bs = tensors[0].size(0)
    words = []
    for t in tensors:
        flat = t.reshape(bs, math.prod(t.size()) // bs if bs else 0)  # [bs, n] (n may be 0)
        if t.dtype.is_floating_point:
            flat = (flat if t.dtype == torch.float64 else flat.to(torch.float64)).view(torch.int64)
        elif t.dtype != torch.int64:
            flat = flat.to(torch.int64)
        words.append(flat)
    return torch.cat(words, dim=1)


def _unpack(layout: list[tuple[tuple[int, ...], torch.dtype]], host: np.ndarray) -> list[np.ndarray]:
    """``_pack``'s inverse on the host copy ``host`` [bs, W]: arrays of the tensors' dtypes and shapes."""
    out, col = [], 0
    bs = layout[0][0][0]
    for shape, dtype in layout:
        n = math.prod(shape) // bs if bs else 0
        part = np.ascontiguousarray(host[:, col:col + n])
        col += n
        part = (part.view(np.float64) if dtype.is_floating_point else part).astype(_NUMPY[dtype])
        out.append(part.reshape(shape))
    return out
