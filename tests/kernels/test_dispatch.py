"""ddtree_serve/kernels/dispatch.py: import failures are recorded with their reason, and a required library that does
not import is an error naming the reason (the GPU check's DDTREE_REQUIRE_CUDA_KERNELS=1)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.dispatch import (
    ALLOW_TORCH_TREE_WALK_ENV,
    SGL_KERNEL,
    CudaKernelUnavailable,
    backend_name,
    check_tree_walk,
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


@pytest.mark.skipif(import_cuda_library(SGL_KERNEL) is not None, reason="sgl-kernel imports here")
def test_a_speculative_worker_on_cuda_without_sgl_kernel_is_a_start_up_error(monkeypatch):
    """The silent torch-walk fallback on CUDA is a start-up error (sgl-kernel does not import on this machine),
    unless the reference walk is asked for; on the CPU the reference is the implementation."""
    monkeypatch.delenv("DDTREE_KERNELS", raising=False)
    monkeypatch.delenv(ALLOW_TORCH_TREE_WALK_ENV, raising=False)
    with pytest.raises(CudaKernelUnavailable, match=f"sgl-kernel does not import.*{ALLOW_TORCH_TREE_WALK_ENV}=1"):
        check_tree_walk(torch.device("cuda", 0))
    check_tree_walk("cpu")
    monkeypatch.setenv(ALLOW_TORCH_TREE_WALK_ENV, "1")
    check_tree_walk("cuda")
    monkeypatch.delenv(ALLOW_TORCH_TREE_WALK_ENV)
    monkeypatch.setenv("DDTREE_KERNELS", "torch")
    check_tree_walk("cuda")
