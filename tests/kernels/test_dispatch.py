"""ddtree_serve/kernels/dispatch.py: import failures are recorded with their reason, and a required library that does
not import is an error naming the reason (the GPU check's DDTREE_REQUIRE_CUDA_KERNELS=1)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.dispatch import (
    CudaKernelUnavailable,
    backend_name,
    cuda_kernels_required,
    import_cuda_library,
    import_error,
    require_cuda_library,
)

_MISSING = "ddtree_no_such_cuda_library"


def test_import_failure_is_recorded_with_its_reason():
    assert import_cuda_library(_MISSING) is None
    assert import_error(_MISSING).startswith("ModuleNotFoundError")
    assert import_error("math") == ""
    with pytest.raises(CudaKernelUnavailable, match=f"test needs {_MISSING}.*ModuleNotFoundError"):
        require_cuda_library(_MISSING, "test")


def test_require_switch_and_cpu_tensors(monkeypatch):
    monkeypatch.delenv("DDTREE_REQUIRE_CUDA_KERNELS", raising=False)
    assert not cuda_kernels_required()
    monkeypatch.setenv("DDTREE_REQUIRE_CUDA_KERNELS", "1")
    assert cuda_kernels_required()
    # CPU tensors run the reference by definition: not a fallback, even when required
    assert backend_name(torch.zeros(2), library=_MISSING) == "torch reference"
