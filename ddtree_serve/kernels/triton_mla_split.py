"""Split-K (flash-decoding) variant of the Triton MLA kernel: each program walks one chunk of its token's
keys and the chunks are merged by their log-sum-exp (the idea of Dao et al.'s Flash-Decoding, 2023).

Why: ``ddtree_serve/kernels/triton_mla.py`` runs one program per (new token, head block), walking all of the token's
keys. At small batch and long context (Kimi K2.6 at TP 8, batch 1: 8 local heads, one program per layer)
that leaves all but one SM idle. Here the grid is (token, head block, split): split ``s`` of a token with
``n`` visible-range keys walks keys ``[s * c, min((s + 1) * c, n))`` with ``c = ceil(n / S)`` rounded up to
``BLOCK_N``, and stores its normalised partial output ``o_s = acc_s / l_s`` ``[Hr, L]`` and
``lse_s = m_s + log2(l_s)`` (base 2, as the kernel's scores; ``-inf`` for a split with no visible key).
The merge computes ``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``, which
is the softmax over all keys. Masks and lengths are the main kernel's (decode, causal extend, tree verify), and so is the fp8 cache's
per-tile dequantization: the kernels run the same query load and key loop (ddtree_serve/kernels/triton_mla_keys.py) over
their own key range, after the same host-side set-up (ddtree_serve/kernels/triton_mla_launch.py).
The split count comes from ``ddtree_serve/kernels/triton_mla_plan.choose_kv_splits``; the tiles from
``choose_mla_tiles`` (same shared memory as the main kernel).

Decode context parallelism (ddtree_serve/kernels/triton_mla_dcp.py): ``_mla_dcp_split_kernel`` runs the same chunks with
the key loop's shard filter on (a chunk keeps only the keys of its rank's shard, so some chunks of a rank
may hold none: lse -inf, weight 0), and the merge also writes the merged natural-log lse (``LSE_OUT``: -inf
and output 0 where no chunk saw a key), the partial that ddtree_serve/model_executor/layers/dcp_attention.py merges
across the ranks. Both stage-1 kernels share ``split_range`` and ``split_store``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.triton_mla_keys import mla_attend, mla_token
from ddtree_serve.kernels.triton_mla_launch import MlaLaunch

LN2_C = tl.constexpr(0.6931471805599453)  # ln 2: the kernels' base-2 scores -> a natural-log lse
# heads per merge program, whatever the attention tiles: its float32 [BLOCK_H, L] accumulator is registers only
# (at 64 heads and L 512, 4 warps, ptxas spills ~14 KB per thread; at 16, none: benchmarks/triton_smem_check.py)
MERGE_BLOCK_H = 16


@triton.jit
def split_range(n_kv, num_splits, pid_s, BLOCK_N: tl.constexpr):
    """Split ``pid_s`` of a token with ``n_kv`` key columns -> its columns ``[lo, hi)``: chunks of
    ``ceil(n_kv / num_splits)`` rounded up to ``BLOCK_N``; a split past the end gets ``lo >= hi`` (no key)."""
    chunk = tl.cdiv(tl.cdiv(n_kv, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, n_kv)
    return lo, hi


@triton.jit
def split_store(m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask, o_part_ptr, lse_ptr, pid_t, pid_s, stride_pt,
                stride_ps, stride_ph, stride_lt, stride_ls):
    """Store a split's normalised partial ``acc / l_i`` [BH, BL] float32 and its base-2 log-sum-exp
    ``m_i + log2(l_i)`` [BH] (-inf and output 0 for a head that saw no key in the split)."""
    seen = l_i > 0  # [BH] False: no visible key in this split
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BH, BL]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BH]
    o = o_part_ptr + pid_t * stride_pt + pid_s * stride_ps + offs_h[:, None] * stride_ph + offs_l[None, :]
    tl.store(o, out, mask=h_mask[:, None] & l_mask[None, :])
    tl.store(lse_ptr + pid_t * stride_lt + pid_s * stride_ls + offs_h, lse, mask=h_mask)


@triton.jit
def _mla_split_kernel(
    q_ptr,
    cache_ptr,
    kv_idx_ptr,
    mask_ptr,
    tok_req_ptr,
    tok_pos_ptr,
    kv_len_ptr,
    prefix_ptr,
    scale_ptr,
    o_part_ptr,
    lse_ptr,
    sm_scale_log2,
    num_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_slot,
    stride_scale,
    stride_kb,
    stride_mb,
    stride_mq,
    stride_pt,
    stride_ps,
    stride_ph,
    stride_lt,
    stride_ls,
    L: tl.constexpr,
    R: tl.constexpr,
    TREE: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, i, n_kv, pre = mla_token(tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, pid_t)
    lo, hi = split_range(n_kv, num_splits, pid_s, BLOCK_N)
    m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask = mla_attend(
        q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, scale_ptr, pid_t, pid_h, b, i, pre, lo, hi, sm_scale_log2,
        num_heads, 0, stride_qt, stride_qh, stride_slot, stride_scale, stride_kb, stride_mb, stride_mq, L, R,
        TREE, FP8, PRECISION, UPCAST_DOT, BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R, 1,
    )  # fmt: skip
    split_store(m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask, o_part_ptr, lse_ptr, pid_t, pid_s, stride_pt,
                stride_ps, stride_ph, stride_lt, stride_ls)


@triton.jit
def _mla_dcp_split_kernel(
    q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, scale_ptr, o_part_ptr,
    lse_ptr, sm_scale_log2, num_heads, num_splits, dcp_rank, stride_qt, stride_qh, stride_slot, stride_scale,
    stride_kb, stride_mb, stride_mq, stride_pt, stride_ps, stride_ph, stride_lt, stride_ls,
    L: tl.constexpr, R: tl.constexpr, TREE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DCP_SIZE: tl.constexpr,
):  # fmt: skip
    """``_mla_split_kernel`` over rank ``dcp_rank``'s shard of a DCP cache: the same column chunks, the key
    loop's shard filter on (ddtree_serve/kernels/triton_mla_dcp.py)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, i, n_kv, pre = mla_token(tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, pid_t)
    lo, hi = split_range(n_kv, num_splits, pid_s, BLOCK_N)
    m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask = mla_attend(
        q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, scale_ptr, pid_t, pid_h, b, i, pre, lo, hi, sm_scale_log2,
        num_heads, dcp_rank, stride_qt, stride_qh, stride_slot, stride_scale, stride_kb, stride_mb, stride_mq, L,
        R, TREE, FP8, PRECISION, UPCAST_DOT, BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R, DCP_SIZE,
    )  # fmt: skip
    split_store(m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask, o_part_ptr, lse_ptr, pid_t, pid_s, stride_pt,
                stride_ps, stride_ph, stride_lt, stride_ls)


@triton.jit
def _mla_merge_kernel(
    o_part_ptr,
    lse_ptr,
    out_ptr,
    lse_out_ptr,
    num_heads,
    num_splits,
    stride_pt,
    stride_ps,
    stride_ph,
    stride_lt,
    stride_ls,
    stride_ot,
    stride_oh,
    stride_et,
    L: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    LSE_OUT: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < L
    lse_row = lse_ptr + pid_t * stride_lt + offs_h  # [BH]
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(lse_row + s * stride_ls, mask=h_mask, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)  # only padding heads see no key at all
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    part = o_part_ptr + pid_t * stride_pt + offs_h[:, None] * stride_ph + offs_l[None, :]  # [BH, BL]
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(lse_row + s * stride_ls, mask=h_mask, other=float("-inf")) - m)  # [BH]
        o_s = tl.load(part + s * stride_ps, mask=h_mask[:, None] & l_mask[None, :], other=0.0)  # [BH, BL]
        total += w
        acc += w[:, None] * o_s
    seen = total > 0  # [BH] False: no visible key in any split (output 0)
    out = acc / tl.where(seen, total, 1.0)[:, None]  # [BH, BL]
    o = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])
    if LSE_OUT:  # the merged log-sum-exp, natural log (-inf: no visible key)
        lse = tl.where(seen, (m + tl.log2(tl.where(seen, total, 1.0))) * LN2_C, float("-inf"))  # [BH]
        tl.store(lse_out_ptr + pid_t * stride_et + offs_h, lse, mask=h_mask)


def launch_split(s: MlaLaunch, out: torch.Tensor, num_splits: int, dcp_size: int = 1, dcp_rank: int = 0,
                 lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Stage 1 (``num_splits`` chunks per token and head block) into float32 partials, stage 2 merges them
    into ``out`` [T, H, L] (the launch's dtype) and, when given, their log-sum-exp into ``lse_out`` [T, H]
    float32 (natural log; -inf and output 0 for a token and head with no visible key). ``dcp_size`` > 1: the
    keys of rank ``dcp_rank``'s shard only (``_mla_dcp_split_kernel``). Returns ``out``."""
    t, heads = out.shape[:2]
    o_part = torch.empty(t, num_splits, heads, s.lat, dtype=torch.float32, device=out.device)  # [T, S, H, L]
    lse = torch.empty(t, num_splits, heads, dtype=torch.float32, device=out.device)  # [T, S, H]
    head_blocks = triton.cdiv(heads, s.tiles.block_h)
    tail = (*s.strides(), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1))
    if dcp_size > 1:
        _mla_dcp_split_kernel[(t, head_blocks, num_splits)](
            *s.inputs(), o_part, lse, s.scale_log2, heads, num_splits, dcp_rank, *tail, DCP_SIZE=dcp_size,
            **s.meta(),
        )  # fmt: skip
    else:
        _mla_split_kernel[(t, head_blocks, num_splits)](
            *s.inputs(), o_part, lse, s.scale_log2, heads, num_splits, *tail, **s.meta(),
        )  # fmt: skip
    lse_o = lse if lse_out is None else lse_out  # [T, H] (unread without LSE_OUT)
    _mla_merge_kernel[(t, triton.cdiv(heads, MERGE_BLOCK_H))](
        o_part, lse, out, lse_o, heads, num_splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), lse_o.stride(0), L=s.lat,
        BLOCK_H=MERGE_BLOCK_H, BLOCK_L=s.tiles.block_l, LSE_OUT=lse_out is not None, num_warps=4,
    )  # fmt: skip
    return out
