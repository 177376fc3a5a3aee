"""RMSNorm (computed in float32, as transformers does).

``row_invariant`` (set by ``use_invariant_linears`` under ``--enable-deterministic-inference``, docs/DESIGN.md
4.18): on CUDA the norm runs ddtree_serve/kernels/triton_rmsnorm.py, whose per-row reduction order depends on
the hidden size only (a torch GPU reduction may pick its split by the row count). On CPU the torch path below
is kept as is: it is already row-wise (tests/kernels/test_batch_invariant.py)."""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn

from ddtree_serve.kernels.dispatch import kernels_forced_to_torch


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


class RMSNorm(nn.Module):
    row_invariant = False  # switched per instance by ``use_invariant_linears``
    force_triton = False  # tests: run the Triton kernel on any device (CPU tensors need TRITON_INTERPRET=1)

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` runs the Triton kernel: forced, or row-invariant on CUDA with Triton
        importable and ``DDTREE_KERNELS`` not forcing torch."""
        if self.force_triton:
            return True
        return self.row_invariant and x.is_cuda and _triton_importable() and not kernels_forced_to_torch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_triton(x):
            from ddtree_serve.kernels.triton_rmsnorm import triton_rmsnorm

            return triton_rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
