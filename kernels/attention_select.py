"""Pick the attention backend: flashinfer on CUDA when available, the torch reference otherwise."""

from __future__ import annotations

import torch

from kernels.attention import TorchAttentionBackend
from kernels.dispatch import FLASHINFER, import_cuda_library, kernels_forced_to_torch


def get_attention_backend(name: str = "auto", device: torch.device | str | None = None):
    """Return an attention backend instance.

    ``name``: ``"torch"`` (reference, any device), ``"flashinfer"`` (CUDA + flashinfer, RuntimeError
    otherwise) or ``"auto"``: flashinfer when CUDA is available, flashinfer imports, ``device`` (if given)
    is a CUDA device and ``DDTREE_KERNELS`` is not ``torch``; else the torch reference.
    """
    if name == "torch":
        return TorchAttentionBackend()
    if name not in ("auto", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r} (expected 'auto', 'torch' or 'flashinfer')")
    cuda_device = device is None or torch.device(device).type == "cuda"
    available = torch.cuda.is_available() and cuda_device and import_cuda_library(FLASHINFER) is not None
    if name == "auto" and (kernels_forced_to_torch() or not available):
        return TorchAttentionBackend()
    if not available:
        raise RuntimeError("the flashinfer attention backend needs CUDA and the flashinfer package")
    from kernels.attention_flashinfer import FlashInferAttentionBackend

    return FlashInferAttentionBackend(device if device is not None else "cuda")
