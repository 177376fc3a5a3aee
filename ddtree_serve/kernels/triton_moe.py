"""Fused MoE experts as Triton grouped GEMMs, dense (BF16/float) or W4A16 over compressed-tensors INT4.

Pipeline for ``x [T, H]`` routed to ``ids [T, k]`` with ``weights [T, k]`` (layers/moe.py contract):

1. ``align_pairs_by_expert`` (ddtree_serve/kernels/moe_align.py): pair ids sorted by local expert, runs padded to
   ``BLOCK_M`` rows, one expert per block.
2. gate/up GEMM, one program per (block of pairs, ``BLOCK_N`` intermediate columns): both the gate row ``n``
   and the up row ``I_r + n`` of ``w13`` are accumulated in float32 and ``silu(gate) * up`` is written to
   ``inter [T * k, I_r]`` (the activation is fused, no ``[T * k, 2 I_r]`` buffer).
3. down GEMM over ``inter`` with ``w2``; each row is scaled by its routing weight and written to
   ``out [T * k, H]`` (rows of pairs on other ranks' experts stay zero).
4. weighted combine: ``out.view(T, k, H).sum(1)`` (torch; the shared expert is added by the caller).

Batch-invariant mode (``invariant=True``, ``--enable-deterministic-inference``, docs/DESIGN.md 4.18; Thinking
Machines, "Defeating Nondeterminism in LLM Inference"; SGLang ``--enable-deterministic-inference`` and vLLM's
batch invariance): a token's output does not depend on the tokens beside it. The GEMMs already compute each
pair's row alone: every program's tile shape is fixed (``BLOCK_M`` a parameter, ``BLOCK_N`` / ``BLOCK_K`` from
the weights' sizes, never from the token count), the K loop runs in one order, and no atomics. What varies is
step 4, torch's ``sum(1)``, whose reduction strategy a library may pick by the tensor's shape (and which rounds
each pair's row to the activation dtype first). In the mode the down GEMM writes float32 rows and
``_moe_combine_kernel`` adds a token's ``k`` rows in routing-slot order (slot 0 first), in float32, rounding
once.

Weights are read as they are stored, with no dequantized copy: dense ``w [E_r, N, K]``, or INT4
``packed int32 [E_r, N, K / 8]`` (value ``j`` of a row in word ``j // 8`` at bits ``4 * (j % 8)``, nibble =
``q + 8``) with ``scale [E_r, N, K / g]`` (quantization/int4_pack.py), dequantized tile by tile in
registers: ``w = (nibble - 8) * scale``. This is the grouped-GEMM scheme of SGLang's ``fused_moe_triton``
(its ``moe_align_block_size`` + ``fused_moe_kernel``/W4A16 variant), written here from its semantics.

Numerics: products in the activation dtype (``tl.dot``; float32 runs IEEE, not TF32), float32 accumulation,
the gate/up activation applied in float32 before rounding to the activation dtype (the INT4 tile is
dequantized in float32 and rounded to the activation dtype, as the reference's dense weight is). Under the
interpreter the dot operands are upcast to float32 (ddtree_serve/kernels/triton_utils.py ``dot_args``). Runs on CUDA, and on CPU
tensors under ``TRITON_INTERPRET=1`` (how the tests check it against the torch reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.moe_align import AlignedPairs, align_pairs_by_expert
from ddtree_serve.kernels.triton_utils import dot_args


@triton.jit
def _load_weight_tile(
    w_ptr,
    scale_ptr,
    e,
    offs_n,
    offs_k,
    n_mask,
    k_mask,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    INT4: tl.constexpr,
    GROUP: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """[BLOCK_K, BLOCK_N] tile of expert ``e``'s weight (rows offs_n, input columns offs_k), transposed."""
    mask = k_mask[:, None] & n_mask[None, :]
    row = e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BN]
    if INT4:
        words = tl.load(w_ptr + row + (offs_k // 8)[:, None], mask=mask, other=0)  # [BK, BN] int32
        nib = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF  # & drops the arithmetic shift's sign bits
        srow = e.to(tl.int64) * stride_se + offs_n[None, :].to(tl.int64) * stride_sn
        scale = tl.load(scale_ptr + srow + (offs_k // GROUP)[:, None], mask=mask, other=0.0)  # [BK, BN]
        w = (nib - 8).to(tl.float32) * scale.to(tl.float32)
        return w.to(OUT_DTYPE)
    return tl.load(w_ptr + row + offs_k[:, None], mask=mask, other=0.0).to(OUT_DTYPE)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    route_w_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTE: tl.constexpr,
    INT4: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, n] = (A[pair // A_ROW_DIV] @ W[e]^T)[n] over the sorted pairs of one block.

    GATED: W rows [0, N) are gate and [N, 2N) up; out = silu(gate) * up. MUL_ROUTE: out *= route_w[pair]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)  # [BM]
    m_mask = pair < num_pairs
    a_row = (pair // A_ROW_DIV).to(tl.int64) * stride_am  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + a_row[:, None] + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        if UPCAST_DOT:
            a = a.to(tl.float32)
        w = _load_weight_tile(
            w_ptr,
            scale_ptr,
            e,
            offs_n,
            offs_k,
            n_mask,
            k_mask,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            INT4,
            GROUP,
            a_ptr.dtype.element_ty,
        )
        if UPCAST_DOT:
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            w_up = _load_weight_tile(
                w_ptr,
                scale_ptr,
                e,
                offs_n + N,
                offs_k,
                n_mask,
                k_mask,
                stride_we,
                stride_wn,
                stride_se,
                stride_sn,
                INT4,
                GROUP,
                a_ptr.dtype.element_ty,
            )
            if UPCAST_DOT:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTE:
        rw = tl.load(route_w_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)
        acc = acc * rw[:, None]
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_combine_kernel(part_ptr, out_ptr, H, stride_pt, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = sum over slots s = 0, 1, .., TOP_K - 1 in that order of part[t * TOP_K + s, cols], float32."""
    pid_t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] hidden columns
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        row = part_ptr + (pid_t * TOP_K + s).to(tl.int64) * stride_pt
        acc += tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_slots(part: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """part [T * k, H] (pair rows, slot-major per token) -> [T, H] in ``dtype``: each token's k rows added in
    slot order in float32 (``_moe_combine_kernel``; batch-invariant)."""
    t, hidden = part.shape[0] // top_k, part.shape[1]
    out = torch.empty(t, hidden, dtype=dtype, device=part.device)  # [T, H]
    if t:
        block = 256
        _moe_combine_kernel[(t, triton.cdiv(hidden, block))](part, out, hidden, part.stride(0), out.stride(0),
                                                            TOP_K=top_k, BLOCK=block, enable_fp_fusion=False)
    return out


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    route_w: torch.Tensor | None,
    aligned: AlignedPairs,
    n: int,
    k: int,
    a_row_div: int,
    gated: bool,
    group: int,
) -> None:
    int4 = scale is not None
    block_n, block_k = _block(n, 64), _block(k, 64)
    grid = (aligned.block_expert.numel(), triton.cdiv(n, block_n))
    scale_arg = scale if int4 else w  # unused pointer when dense
    _moe_gemm_kernel[grid](
        a,
        w,
        scale_arg,
        out,
        route_w if route_w is not None else a,
        aligned.sorted_pairs,
        aligned.block_expert,
        aligned.num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        scale_arg.stride(0),
        scale_arg.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        GATED=gated,
        MUL_ROUTE=route_w is not None,
        INT4=int4,
        GROUP=group,
        BLOCK_M=aligned.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **dot_args(a.dtype),
    )


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_start: int = 0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    group_size: int = 0,
    block_m: int = 16,
    invariant: bool = False,
) -> torch.Tensor:
    """Routed experts of one layer (partial sum of this rank's experts / slices; the caller all-reduces).

    x [T, H]; weights [T, k] (float32 routing weights); ids [T, k] global expert ids. Dense: ``w13
    [E_r, 2 I_r, H]``, ``w2 [E_r, H, I_r]``. INT4 (``w13_scale`` given): ``w13`` int32 ``[E_r, 2 I_r, H / 8]``
    with ``w13_scale [E_r, 2 I_r, H / g]``, ``w2`` int32 ``[E_r, H, I_r / 8]`` with ``w2_scale
    [E_r, H, I_r / g]``, ``g = group_size`` (a multiple of 8). Returns [T, H] in x's dtype. ``invariant``:
    batch-invariant combine (module docstring: float32 pair rows added in slot order), for
    ``--enable-deterministic-inference``; the default keeps today's combine bit for bit."""
    t, hidden = x.shape
    top_k = ids.shape[1]
    int4 = w13_scale is not None
    num_local = w13.shape[0]
    inter = w13.shape[1] // 2
    if int4 and (group_size <= 0 or group_size % 8 or w2_scale is None):
        raise ValueError(
            f"INT4 experts need both scales and a group size that is a multiple of 8, got {group_size}"
        )
    x = x.contiguous()
    aligned = align_pairs_by_expert(ids, expert_start, num_local, block_m)
    inter_out = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)  # [T*k, I_r]
    _gemm(x, w13, w13_scale, inter_out, None, aligned, inter, hidden, top_k, True, group_size)
    out_dtype = torch.float32 if invariant else x.dtype
    out = torch.zeros(t * top_k, hidden, dtype=out_dtype, device=x.device)  # [T*k, H]
    route_w = weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    _gemm(inter_out, w2, w2_scale, out, route_w, aligned, hidden, inter, 1, False, group_size)
    if invariant:
        return combine_slots(out, top_k, x.dtype)  # [T, H]
    return out.view(t, top_k, hidden).sum(1)  # [T, H]
