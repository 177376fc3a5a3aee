"""Host values to the device without a synchronisation (docs/DESIGN.md 4.17).

``torch.tensor(values, device=cuda)`` copies from pageable memory and waits for the stream (a
``cudaStreamSynchronize``): inside a step it blocks the host until every queued kernel is done, closing the
overlap window. ``upload`` builds the tensor on the host, pins it on CUDA, and copies it with ``non_blocking``:
the copy is queued on the stream like a kernel and the host goes on (PyTorch's pinned-memory allocator keeps the
buffer alive until the copy is done)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` on ``device``, copied asynchronously (see the module docstring)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
