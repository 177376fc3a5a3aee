"""The step's read of device results as one named act (docs/DESIGN.md 4.17): several per-request tensors packed
into one buffer and copied to the host once, so a step synchronises once for all of them (the accepted paths,
their tokens, the controller's reach) instead of once per tensor. ``read_later`` starts that copy without waiting
(into pinned memory, fenced by an event) so the host can queue more device work, the next step's draft, before it
waits for the results: the wait then blocks only until the copy is done, not until the work queued after it."""

from __future__ import annotations

import numpy as np
import torch

from ddtree_serve.kernels.dispatch import record_event


def read_back(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Host copies of ``tensors`` (each ``[bs, ...]``, integer, boolean or floating) with one device-to-host copy:
    every tensor's rows as 64-bit words (floats widened to float64 exactly, then their bits) side by side in one
    ``[bs, W]`` buffer, unpacked to arrays of the original dtypes and shapes."""
    if not tensors:
        return []
    packed = _pack(tensors)
    return _unpack(tensors, packed.cpu().numpy())  # [bs, W]: the one read


class PendingRead:
    """``read_back``'s copy in flight (``read_later``): ``wait()`` blocks until it has landed and unpacks it."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._meta = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors)  # shapes, dtypes
        packed = _pack(tensors)  # [bs, W] on the device
        pinned = packed.device.type == "cuda"
        self._host = torch.empty(tuple(packed.shape), dtype=torch.int64, pin_memory=pinned)  # [bs, W] host
        self._host.copy_(packed, non_blocking=True)  # queued on the stream like a kernel
        self._event = record_event(packed.device)

    def wait(self) -> list[np.ndarray]:
        """The tensors' host copies (``read_back``'s), once the copy is done: the step's one synchronising read."""
        self._event.synchronize()
        return _unpack(self._meta, self._host.numpy())


def read_later(*tensors: torch.Tensor) -> PendingRead:
    """Start ``read_back``'s one copy of ``tensors`` (each ``[bs, ...]``) and return at once (module docstring)."""
    return PendingRead(tensors)


def _pack(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[bs, W] int64: every tensor's rows as 64-bit words (floats as float64 bits), side by side."""
    bs = int(tensors[0].shape[0])
    words = []
    for t in tensors:
        flat = t.reshape(bs, t.numel() // bs if bs else 0)  # [bs, n] (n may be 0)
        words.append(flat.to(torch.float64).view(torch.int64) if flat.is_floating_point() else flat.to(torch.int64))
    return torch.cat(words, dim=1)


def _unpack(tensors: tuple[torch.Tensor, ...], host: np.ndarray) -> list[np.ndarray]:
    """``_pack``'s inverse on the host copy ``host`` [bs, W]: arrays of the tensors' dtypes and shapes."""
    out, col = [], 0
    bs = int(tensors[0].shape[0])
    for t in tensors:
        n = t.numel() // bs if bs else 0
        part = np.ascontiguousarray(host[:, col:col + n])
        col += n
        dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        part = (part.view(np.float64) if t.is_floating_point() else part).astype(dtype)
        out.append(part.reshape(tuple(t.shape)))
    return out
