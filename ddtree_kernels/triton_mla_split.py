"""Split-K (flash-decoding) variant of the Triton MLA kernel: each program walks one chunk of its token's
keys and the chunks are merged by their log-sum-exp (the idea of Dao et al.'s Flash-Decoding, 2023).

Why: ``ddtree_kernels/triton_mla.py`` runs one program per (new token, head block), walking all of the token's
keys. At small batch and long context (Kimi K2.6 at TP 8, batch 1: 8 local heads, one program per layer)
that leaves all but one SM idle. Here the grid is (token, head block, split): split ``s`` of a token with
``n`` visible-range keys walks keys ``[s * c, min((s + 1) * c, n))`` with ``c = ceil(n / S)`` rounded up to
``BLOCK_N``, and stores its normalised partial output ``o_s = acc_s / l_s`` ``[Hr, L]`` and
``lse_s = m_s + log2(l_s)`` (base 2, as the kernel's scores; ``-inf`` for a split with no visible key).
The merge computes ``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``, which
is the softmax over all keys. Masks and lengths are the main kernel's (decode, causal extend, tree verify), and so is the fp8 cache's
per-tile dequantization: both kernels run the same key loop (ddtree_kernels/triton_mla_keys.py) over their own key range.
The split count comes from ``ddtree_kernels/triton_mla_plan.choose_kv_splits``; the tiles from
``choose_mla_tiles`` (same shared memory as the main kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_kernels.triton_mla_keys import mla_key_loop
from ddtree_kernels.triton_mla_plan import MlaTiles
from ddtree_kernels.triton_utils import dot_args


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
    b = tl.load(tok_req_ptr + pid_t).to(tl.int64)
    i = tl.load(tok_pos_ptr + pid_t).to(tl.int64)
    n_kv = tl.load(kv_len_ptr + pid_t)
    pre = tl.load(prefix_ptr + b)
    chunk = tl.cdiv(tl.cdiv(n_kv, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, n_kv)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < L
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    q_row = q_ptr + pid_t * stride_qt + offs_h[:, None] * stride_qh  # [BH, 1]
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)  # [BH, BL]
    q_pe = tl.load(q_row + L + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BH, BR]
    if UPCAST_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    m_i, l_i, acc = mla_key_loop(
        q_ptr, q_lat, q_pe, m_i, l_i, acc, cache_ptr, kv_idx_ptr, mask_ptr, scale_ptr, b, i, pre, lo, hi,
        offs_l, l_mask, offs_r, r_mask, sm_scale_log2, stride_slot, stride_scale, stride_kb, stride_mb,
        stride_mq, L, TREE, FP8, PRECISION, UPCAST_DOT, BLOCK_N,
    )  # fmt: skip
    seen = l_i > 0  # [BH] False: no visible key in this split
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BH, BL]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BH]
    o = o_part_ptr + pid_t * stride_pt + pid_s * stride_ps + offs_h[:, None] * stride_ph + offs_l[None, :]
    tl.store(o, out, mask=h_mask[:, None] & l_mask[None, :])
    tl.store(lse_ptr + pid_t * stride_lt + pid_s * stride_ls + offs_h, lse, mask=h_mask)


@triton.jit
def _mla_merge_kernel(
    o_part_ptr,
    lse_ptr,
    out_ptr,
    num_heads,
    num_splits,
    stride_pt,
    stride_ps,
    stride_ph,
    stride_lt,
    stride_ls,
    stride_ot,
    stride_oh,
    L: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
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
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    o = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])


def launch_split(
    q: torch.Tensor,  # [T, Hr, L + R] contiguous
    cache: torch.Tensor,  # [slots, L + R]
    kv_indices: torch.Tensor,  # [bs, K]
    mask: torch.Tensor,  # [bs, Q, Q] uint8 tree mask (read only when tree)
    tok_req: torch.Tensor,  # [T]
    tok_pos: torch.Tensor,  # [T]
    kv_len: torch.Tensor,  # [T] int32 keys of each token's range
    prefix_lens: torch.Tensor,  # [bs]
    out: torch.Tensor,  # [T, Hr, L] written
    scale_log2: float,
    lat: int,
    tree: bool,
    tiles: MlaTiles,
    num_splits: int,
    k_scale: torch.Tensor | None = None,  # [slots, 2] float32 scales of an fp8 cache
) -> torch.Tensor:
    """Stage 1 (``num_splits`` chunks per token and head block) into float32 partials, stage 2 merges them
    into ``out``. Returns ``out``."""
    scales = k_scale if k_scale is not None else cache  # unread unless fp8
    t, heads, width = q.shape
    o_part = torch.empty(t, num_splits, heads, lat, dtype=torch.float32, device=q.device)  # [T, S, Hr, L]
    lse = torch.empty(t, num_splits, heads, dtype=torch.float32, device=q.device)  # [T, S, Hr]
    head_blocks = triton.cdiv(heads, tiles.block_h)
    _mla_split_kernel[(t, head_blocks, num_splits)](
        q,
        cache,
        kv_indices,
        mask,
        tok_req,
        tok_pos,
        kv_len,
        prefix_lens,
        scales,
        o_part,
        lse,
        scale_log2,
        heads,
        num_splits,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        scales.stride(0),
        kv_indices.stride(0),
        mask.stride(0),
        mask.stride(1),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        L=lat,
        R=width - lat,
        TREE=tree,
        FP8=k_scale is not None,
        BLOCK_H=tiles.block_h,
        BLOCK_N=tiles.block_n,
        BLOCK_L=tiles.block_l,
        BLOCK_R=tiles.block_r,
        num_warps=4,
        num_stages=tiles.num_stages,
        **dot_args(q.dtype),
    )
    _mla_merge_kernel[(t, head_blocks)](
        o_part,
        lse,
        out,
        heads,
        num_splits,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        L=lat,
        BLOCK_H=tiles.block_h,
        BLOCK_L=tiles.block_l,
        num_warps=4,
    )
    return out
