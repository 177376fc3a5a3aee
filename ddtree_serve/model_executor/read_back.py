"""The step's read of device results as one named act (docs/DESIGN.md 4.17): several per-request tensors packed
into one buffer and copied to the host once, so a step synchronises once for all of them (the accepted paths,
their tokens, the controller's reach) instead of once per tensor."""

from __future__ import annotations

import numpy as np
import torch


def read_back(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Host copies of ``tensors`` (each ``[bs, ...]``, integer, boolean or floating) with one device-to-host copy:
    every tensor's rows as 64-bit words (floats widened to float64 exactly, then their bits) side by side in one
    ``[bs, W]`` buffer, unpacked to arrays of the original dtypes and shapes."""
    if not tensors:
        return []
    bs = int(tensors[0].shape[0])
    words = []
    for t in tensors:
        flat = t.reshape(bs, t.numel() // bs if bs else 0)  # [bs, n] (n may be 0)
        words.append(flat.to(torch.float64).view(torch.int64) if flat.is_floating_point() else flat.to(torch.int64))
    host = torch.cat(words, dim=1).cpu().numpy()  # [bs, W]: the one read
    out, col = [], 0
    for t, w in zip(tensors, words, strict=True):
        part = np.ascontiguousarray(host[:, col:col + w.shape[1]])
        col += w.shape[1]
        dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        part = (part.view(np.float64) if t.is_floating_point() else part).astype(dtype)
        out.append(part.reshape(tuple(t.shape)))
    return out
