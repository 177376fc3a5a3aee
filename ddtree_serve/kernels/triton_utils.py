"""Launch-time choices shared by the Triton kernels (ddtree_serve/kernels/triton_moe.py, ddtree_serve/kernels/triton_mla.py)."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_args(dtype: torch.dtype) -> dict[str, object]:
    """Constexpr kwargs for ``tl.dot`` in our kernels: ``PRECISION`` ("ieee" for float32 operands, so
    float32 runs are not silently TF32) and ``UPCAST_DOT``: under the interpreter the dot operands are upcast
    to float32, because the interpreter's ``tl.dot`` mishandles 16-bit floats (numpy has no bfloat16; loads,
    stores and casts of bfloat16 are exact there, products are not). On a GPU the operands stay 16-bit."""
    return {"PRECISION": "ieee" if dtype == torch.float32 else "tf32", "UPCAST_DOT": interpreting()}
