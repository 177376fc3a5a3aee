"""A batch-invariant GEMM in Triton: ``y = x @ w.T (+ bias)``, the ``nn.Linear`` product, whose row results do not
depend on how many rows run beside them or where the row sits (``--enable-deterministic-inference`` on a GPU).

Why: a library GEMM (cuBLAS) picks its kernel by the problem's shape, M included: other tiles, split-K (K cut into
pieces summed in another order) or a stream-K schedule for one M than for another, so a row's float32 sum, and
its rounding to bfloat16, change with the batch. Source: Thinking Machines, "Defeating Nondeterminism in LLM
Inference" (He et al., 2025: a matmul with fixed tiles along K and N, no split-K, one reduction order over K for
every M), the scheme of SGLang's ``--enable-deterministic-inference`` and vLLM's batch-invariant mode; written
here from that description.

The kernel, for x [M, K], w [N, K] (row-major, as nn.Linear stores it), bias [N] or none:

- one program per output tile of ``BLOCK_M x BLOCK_N`` (grid ``[batch, cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)]``;
  ``invariant_gemm`` has one batch item, ``invariant_matmul``, the batched ``torch.matmul`` of
  ``row_block_matmul``, up to 3 broadcast batch dims), with
  ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps`` and ``num_stages`` chosen from (dtype, K, N) only
  (``gemm_tiles``), never from M; no split-K: each program walks K from 0 up in ``BLOCK_K`` steps, accumulating
  ``tl.dot`` products in float32, so every element of y is the same sequence of operations whatever M is and
  whichever tile row holds it; rows past M (and columns past N, K past its end) are masked loads of 0;
- the bias is added to the float32 sum once, after the K walk; the result is rounded to x's dtype;
- ``M`` is not specialised (``do_not_specialize``: Triton would otherwise compile another variant when M is a
  multiple of 16) and ``enable_fp_fusion`` is passed at every launch (False). Addresses and strides keep
  Triton's divisibility-by-16 hints (a row slice's address, the batched form's batch strides M * K): they set
  the width of loads and stores only, not the dot's tiles, instruction or order (the GPU test slices rows at
  unaligned offsets to check it); dropping them would cost vectorised loads.

Numerics: float32 operands run ``tl.dot`` in IEEE precision (not TF32); bfloat16 / float16 operands multiply in
their dtype on a GPU (exact products, float32 sums). Under the interpreter (``TRITON_INTERPRET=1``, how the
tests run it on CPU tensors) the dot operands are upcast to float32 (``triton_utils.dot_args``). Row invariance
is checked under the interpreter (tests/kernels/test_triton_invariant_gemm.py) and on CUDA
(tests/gpu/test_invariant_gemm_cuda.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.triton_utils import dot_args

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmTiles:
    """The fixed launch shape of one (dtype, K, N): never a function of M."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_tiles(dtype: torch.dtype, k: int, n: int) -> GemmTiles:
    """Tiles for x [*, k] @ w [n, k].T in ``dtype``: 64 x 128 x 64 for 16-bit inputs, 32 x 64 x 32 for float32
    (an IEEE float32 dot runs on the CUDA cores, a larger tile spills), narrowed to a power of two >= 16 when N or
    K is smaller. Depends on (dtype, K, N) only."""
    if dtype not in DTYPES:
        raise ValueError(f"the invariant GEMM takes {', '.join(map(str, DTYPES))}; got {dtype}")
    wide = dtype != torch.float32
    bm, bn, bk = (64, 128, 64) if wide else (32, 64, 32)
    bn = max(16, min(bn, triton.next_power_of_2(n)))
    bk = max(16, min(bk, triton.next_power_of_2(k)))
    return GemmTiles(bm, bn, bk, num_warps=4, num_stages=3 if wide else 2)


@triton.jit(do_not_specialize=["M"])
def _invariant_gemm_kernel(
    x_ptr,  # [D0, D1, D2, M, K], K contiguous
    w_ptr,  # [D0, D1, D2, N, K] (element (n, k) at n * stride_wn + k, or k * stride_wk + n)
    bias_ptr,  # [N] (unused without HAS_BIAS)
    out_ptr,  # [D0, D1, D2, M, N], N contiguous
    M,
    N,
    K,
    D1,
    D2,
    stride_x0,
    stride_x1,
    stride_x2,
    stride_xm,
    stride_w0,
    stride_w1,
    stride_w2,
    stride_wn,
    stride_wk,
    stride_o0,
    stride_o1,
    stride_o2,
    stride_om,
    W_K_CONTIGUOUS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[b, m, n] = sum_k x[b, m, k] w[b, n, k] (+ bias[n]) for the tile (batch item b, pid_m, pid_n): K walked
    in order, float32 sum. Batch strides may be 0 (broadcast)."""
    pid_b = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    i0 = (pid_b // (D1 * D2)).to(tl.int64)
    i1 = ((pid_b // D2) % D1).to(tl.int64)
    i2 = (pid_b % D2).to(tl.int64)
    x_ptr += i0 * stride_x0 + i1 * stride_x1 + i2 * stride_x2
    w_ptr += i0 * stride_w0 + i1 * stride_w1 + i2 * stride_w2
    out_ptr += i0 * stride_o0 + i1 * stride_o1 + i2 * stride_o2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        if W_K_CONTIGUOUS:
            w_tile = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
        else:
            w_tile = w_ptr + offs_k.to(tl.int64)[:, None] * stride_wk + offs_n[None, :]  # [BK, BN]
        b = tl.load(w_tile, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)  # [BM, BN] float32
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _batch3(t: torch.Tensor, batch: tuple[int, ...], rows: int, cols: int) -> tuple[torch.Tensor, list[int]]:
    """``t`` expanded to [*batch, rows, cols] (a view, 0 strides where broadcast) and its 3 batch strides (batch
    has at most 3 dims; leading missing dims get stride 0)."""
    e = t.expand(*batch, rows, cols)
    strides = list(e.stride()[:-2])
    return e, [0] * (3 - len(strides)) + strides


def _launch(
    x: torch.Tensor,  # [*batch, M, K], K contiguous
    w: torch.Tensor,  # [*batch, N, K] (any strides)
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [*batch, M, N] contiguous
    tiles: GemmTiles | None,
) -> torch.Tensor:
    batch, m, k, n = out.shape[:-2], x.shape[-2], x.shape[-1], w.shape[-2]
    t = tiles or gemm_tiles(x.dtype, k, n)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    x, xs = _batch3(x, tuple(batch), m, k)
    if w.stride(-1) != 1 and w.stride(-2) != 1:
        w = w.contiguous()
    w, ws = _batch3(w, tuple(batch), n, k)
    _, os_ = _batch3(out, tuple(batch), m, n)
    b3 = [1] * (3 - len(batch)) + list(batch)
    bias_arg = bias.contiguous() if bias is not None else out  # unused pointer without a bias
    grid = (b3[0] * b3[1] * b3[2], triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
    _invariant_gemm_kernel[grid](
        x, w, bias_arg, out,
        m, n, k, b3[1], b3[2],
        *xs, x.stride(-2),
        *ws, w.stride(-2), w.stride(-1),
        *os_, out.stride(-2),
        W_K_CONTIGUOUS=w.stride(-1) == 1,
        HAS_BIAS=bias is not None,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        enable_fp_fusion=False,
        **dot_args(x.dtype),
    )
    return out


def _check_dtypes(*tensors: torch.Tensor | None) -> None:
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1:
        raise ValueError(f"the invariant GEMM's operands must share a dtype; got {sorted(map(str, dtypes))}")


def invariant_gemm(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    tiles: GemmTiles | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``F.linear(x, weight, bias)`` by the batch-invariant Triton kernel: a row's result is bit-identical for
    every M and every position of the row. ``tiles``: override the fixed tiles (tests only; default
    ``gemm_tiles(dtype, K, N)``). Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"invariant_gemm takes x [M, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    _check_dtypes(x, weight, bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # [M, N]
    return _launch(x, weight, bias, out, tiles)


def invariant_matmul(
    a: torch.Tensor,  # [..., M, K]
    b: torch.Tensor,  # [..., K, N], leading dims broadcast against a's (at most 3 batch dims)
    tiles: GemmTiles | None = None,
) -> torch.Tensor:  # [..., M, N] in a's dtype
    """``torch.matmul(a, b)`` for batched operands by the same kernel, one batch item per program row: a row's
    result does not depend on M nor on the row's position (``row_block_matmul`` on CUDA)."""
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"invariant_matmul takes a [..., M, K] and b [..., K, N]; got {tuple(a.shape)}, {tuple(b.shape)}")
    _check_dtypes(a, b)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if len(batch) > 3:
        raise ValueError(f"invariant_matmul takes at most 3 batch dims; got {tuple(batch)}")
    a = a if a.stride(-1) == 1 else a.contiguous()
    out = torch.empty(*batch, a.shape[-2], b.shape[-1], dtype=a.dtype, device=a.device)  # [*batch, M, N]
    return _launch(a, b.transpose(-1, -2), None, out, tiles)
