"""Pick the attention backend: flashinfer on CUDA for the shapes and dtypes it compiles, else the torch
reference.

flashinfer's prefill/decode kernels take 16-bit queries and KV only (float16, bfloat16; its JIT has no
float32 instantiation) and head dims that its FA2/FA3 paths instantiate and test (64, 128, 256, with
``head_dim_vo == head_dim``). ``select_attention_backend`` decides from those facts alone (no CUDA
needed, so the rule is tested on CPU); ``get_attention_backend`` builds the instance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.kernels.dispatch import (
    FLASHINFER,
    CudaKernelUnavailable,
    cuda_kernels_required,
    import_cuda_library,
    import_error,
    kernels_forced_to_torch,
)

logger = logging.getLogger(__name__)

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class AttentionChoice:
    backend: str  # "torch" | "flashinfer"
    reason: str  # why, for the start-up log and the GPU check's report


def flashinfer_unsupported(dtype: torch.dtype | None, head_dim: int | None, head_dim_vo: int | None) -> str:
    """Why flashinfer cannot run this shape/dtype ("" when it can). None = not known (not checked)."""
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"flashinfer attention is 16-bit only (float16/bfloat16), got {dtype}"
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return f"flashinfer attention head_dim must be one of {FLASHINFER_HEAD_DIMS}, got {head_dim}"
    if head_dim is not None and head_dim_vo is not None and head_dim_vo != head_dim:
        return f"flashinfer attention needs head_dim_vo == head_dim, got {head_dim_vo} != {head_dim}"
    return ""


def select_attention_backend(
    name: str,
    device: torch.device | str | None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    head_dim_vo: int | None = None,
    cuda_available: bool | None = None,
    flashinfer_imports: bool | None = None,
) -> AttentionChoice:
    """The backend ``get_attention_backend`` builds, as data.

    ``name``: ``"torch"``; ``"flashinfer"`` (ValueError when dtype/head dims rule it out, RuntimeError
    without CUDA or flashinfer); ``"auto"``: flashinfer when the device is CUDA, flashinfer imports,
    ``DDTREE_KERNELS`` is not ``torch`` and dtype/head dims fit, else the torch reference. Under
    ``DDTREE_REQUIRE_CUDA_KERNELS=1`` an "auto" choice on CUDA whose shapes fit flashinfer but whose
    library does not import raises ``CudaKernelUnavailable`` (a float32 model choosing torch is not a
    fallback: flashinfer cannot run it). ``cuda_available``/``flashinfer_imports`` default to probing.
    """
    if name == "torch":
        return AttentionChoice("torch", "requested")
    if name not in ("auto", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r} (expected 'auto', 'torch' or 'flashinfer')")
    on_cuda = device is None or torch.device(device).type == "cuda"
    unsupported = flashinfer_unsupported(dtype, head_dim, head_dim_vo)
    if name == "flashinfer" and unsupported:
        raise ValueError(f"--attention-backend flashinfer: {unsupported}; use 'torch' or a 16-bit dtype")
    if name == "auto" and not on_cuda:
        return AttentionChoice("torch", f"device {device} is not CUDA")
    if name == "auto" and unsupported:
        return AttentionChoice("torch", unsupported)
    if name == "auto" and kernels_forced_to_torch():
        if cuda_kernels_required():
            raise CudaKernelUnavailable("DDTREE_REQUIRE_CUDA_KERNELS=1 contradicts DDTREE_KERNELS=torch")
        return AttentionChoice("torch", "DDTREE_KERNELS=torch")
    cuda_ok = torch.cuda.is_available() if cuda_available is None else cuda_available
    fi_ok = (
        (import_cuda_library(FLASHINFER) is not None) if flashinfer_imports is None else flashinfer_imports
    )
    if cuda_ok and on_cuda and fi_ok:
        return AttentionChoice("flashinfer", "CUDA, 16-bit, supported head dim")
    why = (
        "CUDA is not available" if not cuda_ok else f"flashinfer does not import ({import_error(FLASHINFER)})"
    )
    if name == "flashinfer":
        raise RuntimeError(f"the flashinfer attention backend cannot run: {why}")
    if cuda_kernels_required():
        raise CudaKernelUnavailable(f"attention on {device} would fall back to torch: {why}")
    return AttentionChoice("torch", why)


def get_attention_backend(
    name: str = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    head_dim_vo: int | None = None,
):
    """Return an attention backend instance for a model of ``dtype`` and ``head_dim``/``head_dim_vo``
    on ``device`` (rules in ``select_attention_backend``); logs the choice and why."""
    choice = select_attention_backend(name, device, dtype, head_dim, head_dim_vo)
    logger.info("attention backend: %s (%s)", choice.backend, choice.reason)
    if choice.backend == "torch":
        return TorchAttentionBackend()
    from ddtree_serve.kernels.attention_flashinfer import FlashInferAttentionBackend

    return FlashInferAttentionBackend(device if device is not None else "cuda")
