"""Choose between the PyTorch reference and a CUDA library (sgl-kernel, flashinfer) per call.

The CUDA path is taken only when every tensor of the call lives on a CUDA device, the library imports,
and the environment does not force the reference (``DDTREE_KERNELS=torch``). sgl-kernel raises
ImportError on machines without CUDA (missing libnvrtc), so imports are probed inside try/except.
No module-level mutable state: the import probe is memoised with ``functools.lru_cache``.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

SGL_KERNEL = "sgl_kernel"
FLASHINFER = "flashinfer"
_ENV = "DDTREE_KERNELS"


@functools.cache
def import_cuda_library(name: str) -> ModuleType | None:
    """Import ``name`` (``"sgl_kernel"``, ``"flashinfer"`` or a submodule such as ``"flashinfer.sampling"``)
    once; None when it is not installed or cannot load (no CUDA runtime)."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError, RuntimeError):
        return None


def kernels_forced_to_torch() -> bool:
    """True when ``DDTREE_KERNELS=torch`` asks for the PyTorch reference everywhere."""
    return os.environ.get(_ENV, "").strip().lower() == "torch"


def use_cuda_kernels(*tensors: torch.Tensor, library: str = SGL_KERNEL) -> bool:
    """True when the CUDA implementation of ``library`` should run for a call on ``tensors``.

    Requires: CUDA available, every tensor on a CUDA device (at least one tensor given), ``library``
    importable, and ``DDTREE_KERNELS`` not set to ``torch``.
    """
    if kernels_forced_to_torch() or not tensors:
        return False
    if not torch.cuda.is_available():
        return False
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    return import_cuda_library(library) is not None
