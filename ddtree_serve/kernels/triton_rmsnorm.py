"""Batch-invariant RMSNorm as a Triton kernel (``--enable-deterministic-inference``, docs/DESIGN.md 4.18).

Source: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (He et al., 2025) names RMSNorm among
the three kernels to make batch-invariant: a GPU reduction library picks its launch configuration (block
shape, how a row's reduction is split across threads) from the tensor's shape, rows included, so a row's sum
of squares may be added in another order when more rows run beside it. Here the order is fixed by the hidden
size alone:

- one program per row (grid ``(rows,)``), nothing shared between rows, no atomics;
- the row is walked in ``BLOCK``-wide chunks in index order (``BLOCK`` from the hidden size, never from the
  row count: ``rmsnorm_block``); chunk ``c``'s squares are added elementwise, in float32, into a ``[BLOCK]``
  accumulator, which one ``tl.sum`` reduces at the end (its tree fixed by ``BLOCK`` and ``NUM_WARPS``);
- a fixed ``num_warps`` and ``enable_fp_fusion=False`` (as ddtree_serve/kernels/triton_mla_invariant.py), so
  the compiler computes the written float operations, with no per-kernel choice of where a multiply-add fuses.

Numerics follow ddtree_serve/model_executor/layers/norm.py's torch ``RMSNorm`` operation by operation:
``y = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``, then ``out = weight * y`` in the promoted dtype of
``weight`` and ``x`` (x's dtype when they match; a product of two bf16 or fp16 values is exact in float32, so
computing it there and rounding once equals torch's 16-bit multiply). Only the sum's order differs from torch,
so results are close to it, not equal. Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the
tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 1024  # widest chunk; hidden sizes above it are walked in several chunks
NUM_WARPS = 4  # fixed for every launch: the reduction tree of ``tl.sum`` must not vary


def rmsnorm_block(hidden: int) -> int:
    """The chunk width for a row of ``hidden`` elements: the next power of two, at most ``MAX_BLOCK``. A
    function of the hidden size only."""
    return min(triton.next_power_of_2(hidden), MAX_BLOCK)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [T, H] rows at stride_x
    w_ptr,  # [H]
    out_ptr,  # [T, H] rows at stride_o
    hidden,
    eps,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):  # chunks in index order
        mask = start + offs < hidden
        xf = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        acc += xf * xf
    mean = tl.sum(acc, axis=0) / hidden
    rstd = tl.rsqrt(mean + eps)
    for start in range(0, hidden, BLOCK):
        mask = start + offs < hidden
        x = tl.load(x_row + start + offs, mask=mask, other=0.0)
        y = (x.to(tl.float32) * rstd).to(x.dtype)  # norm.py: xf * rsqrt(...), cast back to x's dtype
        w = tl.load(w_ptr + start + offs, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)  # exact for 16-bit operands: one rounding, as torch's
        tl.store(o_row + start + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def triton_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, block: int | None = None) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` with ``weight [H]``, each row alone (batch-invariant). Returns ``[..., H]`` in
    ``torch.promote_types(weight.dtype, x.dtype)`` (the torch module's result dtype; x's dtype when they match).
    ``block``: the chunk width (a power of two; default ``rmsnorm_block(H)``; tests pass smaller ones to walk
    several chunks at small sizes)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    block = rmsnorm_block(hidden) if block is None else block
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of two; got {block}")
    x2 = x.reshape(-1, hidden)  # [T, H]
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)  # [T, H]
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, hidden, eps, x2.stride(0), out.stride(0), BLOCK=block,
            num_warps=NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(x.shape)
