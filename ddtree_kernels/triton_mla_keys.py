"""The key loop shared by the Triton MLA kernels (ddtree_kernels/triton_mla.py, ddtree_kernels/triton_mla_split.py).

``mla_key_loop`` walks keys ``[lo, hi)`` of request ``b``'s ``kv_indices`` row in ``BLOCK_N`` tiles and
folds them into an online softmax ``(m_i, l_i, acc)`` (FlashAttention, Dao et al. 2022), base 2: scores
are ``sm_scale_log2 * (q_lat . c_kv + q_pe . k_pe)``, the latent tile ``c_kv`` serves as V. The single-pass
kernel calls it with ``[0, n_kv)``, each split-K program with its own chunk. Per tile: load the cache rows
through ``kv_indices``, dequantize an fp8 tile with its per-token scales (ddtree_kernels/kv_quant.py), mask keys
past ``hi`` and, in ``TREE`` mode, new keys that are not the token's ancestors (``tree_mask[b, i, j -
prefix]``). A fully masked tile leaves the state unchanged.

A ``@triton.jit`` helper: Triton inlines it into each caller, so the compiled kernels are those of the
loop written out in place (benchmarks/triton_smem_check.py reports their shared memory, registers and
spills).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_key_loop(
    q_ptr,
    q_lat,  # [BH, BL] the query's latent part (float32 when UPCAST_DOT)
    q_pe,  # [BH, BR] its rope part
    m_i,  # [BH] running max (base 2)
    l_i,  # [BH] running sum of 2^(s - m_i)
    acc,  # [BH, BL] float32 running weighted sum of latent rows
    cache_ptr,
    kv_idx_ptr,
    mask_ptr,
    scale_ptr,
    b,
    i,
    pre,
    lo,
    hi,
    offs_l,  # [BL]
    l_mask,  # [BL]
    offs_r,  # [BR]
    r_mask,  # [BR]
    sm_scale_log2,
    stride_slot,
    stride_scale,
    stride_kb,
    stride_mb,
    stride_mq,
    L: tl.constexpr,
    TREE: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys ``[lo, hi)`` folded into ``(m_i, l_i, acc)`` -> the updated ``(m_i, l_i, acc)``."""
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slot = tl.load(kv_idx_ptr + b * stride_kb + offs_n, mask=n_mask, other=0).to(tl.int64)  # [BN]
        k_row = cache_ptr + slot[:, None] * stride_slot  # [BN, 1]
        k_lat = tl.load(
            k_row + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0
        )  # [BN, BL]
        k_pe = tl.load(
            k_row + L + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
        )  # [BN, BR]
        if FP8:  # dequantize the tile to the query's dtype: per-token (latent, rope) scales (ddtree_kernels/kv_quant.py)
            sc_row = scale_ptr + slot * stride_scale  # [BN]
            sc_lat = tl.load(sc_row, mask=n_mask, other=0.0)  # [BN]
            sc_pe = tl.load(sc_row + 1, mask=n_mask, other=0.0)  # [BN]
            k_lat = (k_lat.to(tl.float32) * sc_lat[:, None]).to(q_ptr.dtype.element_ty)
            k_pe = (k_pe.to(tl.float32) * sc_pe[:, None]).to(q_ptr.dtype.element_ty)
        if UPCAST_DOT:
            k_lat = k_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)  # [BH, BN]
        s = s * sm_scale_log2
        visible = n_mask
        if TREE:  # prefix keys always visible; new key j: tree_mask[b, i, j - prefix]
            rel = offs_n - pre
            m = tl.load(mask_ptr + b * stride_mb + i * stride_mq + rel, mask=n_mask & (rel >= 0), other=1)
            visible = visible & (m != 0)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BH]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block adds nothing
        p = tl.exp2(s - m_safe[:, None])  # [BH, BN]
        alpha = tl.exp2(m_i - m_safe)  # [BH]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], input_precision=PRECISION)  # [BH, BL]
        m_i = m_new
    return m_i, l_i, acc
