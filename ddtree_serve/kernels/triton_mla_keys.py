"""The device code shared by the Triton MLA kernels (ddtree_serve/kernels/triton_mla.py, ddtree_serve/kernels/triton_mla_split.py,
ddtree_serve/kernels/triton_mla_dcp.py, ddtree_serve/kernels/triton_mla_extend.py): a kernel reads its token's metadata (``mla_token``), chooses its key range (all of
the token's keys, or its split-K chunk), runs ``mla_attend`` over it and writes its own epilogue (the output,
or a partial output and its log-sum-exp).

``mla_attend`` loads the query tile ``[BLOCK_H, L + R]``, then walks keys ``[lo, hi)`` of request ``b``'s
``kv_indices`` row in ``BLOCK_N`` tiles and folds them into an online softmax ``(m_i, l_i, acc)``
(FlashAttention, Dao et al. 2022), base 2: scores are ``sm_scale_log2 * (q_lat . c_kv + q_pe . k_pe)``, the
latent tile ``c_kv`` serves as V. Per tile: load the cache rows through ``kv_indices``, dequantize an fp8 tile
with its per-token scales (ddtree_serve/kernels/kv_quant.py), mask keys past ``hi`` and, in ``TREE`` mode, new keys that
are not the token's ancestors (``tree_mask[b, i, j - prefix]``). A fully masked tile leaves the state
unchanged.

Shard filter (decode context parallel, ``DCP_SIZE`` > 1): ``kv_indices`` holds global slot ids, global slot
``g`` lives on DCP rank ``g % DCP_SIZE`` at local row ``g // DCP_SIZE`` of that rank's cache; keys of other
ranks are masked before the softmax and the rest read through their local rows. ``DCP_SIZE`` 1 (the
non-DCP kernels) compiles no filter at all.

``mla_key_tile`` (one key tile: slots, shard filter, loads, fp8 dequantization) is also the key load of the
query-tiled extend kernel (ddtree_serve/kernels/triton_mla_extend.py), whose rows are (token, head) pairs.

``@triton.jit`` helpers: Triton inlines them into each caller, so the compiled kernels are those of the code
written out in place (benchmarks/triton_smem_check.py reports their shared memory, registers and spills;
benchmarks/triton_ir_dump.py writes their IR to compare a refactor's before and after).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mla_token(tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, pid_t):
    """New token ``pid_t`` -> (its request ``b``, its index ``i`` among the request's new tokens, its keys
    ``n_kv``, the request's prefix length ``pre``)."""
    b = tl.load(tok_req_ptr + pid_t).to(tl.int64)
    i = tl.load(tok_pos_ptr + pid_t).to(tl.int64)
    n_kv = tl.load(kv_len_ptr + pid_t)
    pre = tl.load(prefix_ptr + b)
    return b, i, n_kv, pre


@triton.jit
def mla_query(
    q_ptr, pid_t, pid_h, num_heads, stride_qt, stride_qh,
    L: tl.constexpr, R: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Heads ``[pid_h * BLOCK_H, +BLOCK_H)`` of new token ``pid_t`` -> ``(q_lat [BH, BL], q_pe [BH, BR], offs_h,
    h_mask, offs_l, l_mask, offs_r, r_mask)``: the query tile (0 past the heads / widths) and its offsets."""
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
    return q_lat, q_pe, offs_h, h_mask, offs_l, l_mask, offs_r, r_mask


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, k_lat, PRECISION: tl.constexpr):
    """Fold one key tile into the online softmax: ``s`` [BH, BN] base-2 scores (-inf where invisible),
    ``k_lat`` [BN, BL] the tile's latent rows (V) -> the new ``(m_i [BH], l_i [BH], acc [BH, BL])``. A fully
    masked tile leaves the state unchanged (bit for bit: ``alpha`` 1, ``p`` 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BH]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block adds nothing
    p = tl.exp2(s - m_safe[:, None])  # [BH, BN]
    alpha = tl.exp2(m_i - m_safe)  # [BH]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], input_precision=PRECISION)  # [BH, BL]
    return m_new, l_i, acc


@triton.jit
def mla_key_tile(
    q_ptr, cache_ptr, kv_idx_ptr, scale_ptr, b, offs_n, n_mask, offs_l, l_mask, offs_r, r_mask, dcp_rank,
    stride_slot, stride_scale, stride_kb,
    L: tl.constexpr, FP8: tl.constexpr, UPCAST_DOT: tl.constexpr, DCP_SIZE: tl.constexpr,
):  # fmt: skip
    """Keys ``offs_n`` [BN] of request ``b`` (``n_mask``: those in range) -> ``(k_lat [BN, BL], k_pe [BN, BR],
    n_mask)``: the cache rows read through ``kv_indices`` (0 where masked), an fp8 tile dequantized to the
    query's dtype, and with ``DCP_SIZE`` > 1 ``n_mask`` narrowed to the keys of rank ``dcp_rank``'s shard
    (global slot ``g``: local row ``g // DCP_SIZE`` of rank ``g % DCP_SIZE``)."""
    slot = tl.load(kv_idx_ptr + b * stride_kb + offs_n, mask=n_mask, other=0).to(tl.int64)  # [BN]
    if DCP_SIZE > 1:  # global slots: keep this rank's keys, read through their local rows
        n_mask = n_mask & (slot % DCP_SIZE == dcp_rank)
        slot = tl.where(n_mask, slot // DCP_SIZE, 0)  # [BN]
    k_row = cache_ptr + slot[:, None] * stride_slot  # [BN, 1]
    k_lat = tl.load(k_row + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)  # [BN, BL]
    k_pe = tl.load(k_row + L + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BN, BR]
    if FP8:  # dequantize the tile to the query's dtype: per-token (latent, rope) scales (kv_quant.py)
        sc_row = scale_ptr + slot * stride_scale  # [BN]
        sc_lat = tl.load(sc_row, mask=n_mask, other=0.0)  # [BN]
        sc_pe = tl.load(sc_row + 1, mask=n_mask, other=0.0)  # [BN]
        k_lat = (k_lat.to(tl.float32) * sc_lat[:, None]).to(q_ptr.dtype.element_ty)
        k_pe = (k_pe.to(tl.float32) * sc_pe[:, None]).to(q_ptr.dtype.element_ty)
    if UPCAST_DOT:
        k_lat = k_lat.to(tl.float32)
        k_pe = k_pe.to(tl.float32)
    return k_lat, k_pe, n_mask


@triton.jit
def mla_attend(
    q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, scale_ptr,  # the kernel's inputs
    pid_t, pid_h, b, i, pre, lo, hi,  # the program's token and head block, its keys [lo, hi)
    sm_scale_log2, num_heads, dcp_rank,  # dcp_rank: read only when DCP_SIZE > 1
    stride_qt, stride_qh, stride_slot, stride_scale, stride_kb, stride_mb, stride_mq,
    L: tl.constexpr, R: tl.constexpr, TREE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DCP_SIZE: tl.constexpr,
):  # fmt: skip
    """Heads ``[pid_h * BLOCK_H, +BLOCK_H)`` of new token ``pid_t`` over keys ``[lo, hi)`` (with ``DCP_SIZE``
    > 1 only those of rank ``dcp_rank``'s shard) -> ``(m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask)``: the
    online softmax state (``m_i`` [BH] running max, base 2; ``l_i`` [BH] running sum of ``2^(s - m_i)``, 0 for a
    head that saw no key; ``acc`` [BH, BL] float32 unnormalised sum of latent rows) and the head / latent
    offsets and masks of the output tile."""
    q_lat, q_pe, offs_h, h_mask, offs_l, l_mask, offs_r, r_mask = mla_query(
        q_ptr, pid_t, pid_h, num_heads, stride_qt, stride_qh, L, R, UPCAST_DOT, BLOCK_H, BLOCK_L, BLOCK_R,
    )  # fmt: skip
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k_lat, k_pe, n_mask = mla_key_tile(
            q_ptr, cache_ptr, kv_idx_ptr, scale_ptr, b, offs_n, n_mask, offs_l, l_mask, offs_r, r_mask, dcp_rank,
            stride_slot, stride_scale, stride_kb, L, FP8, UPCAST_DOT, DCP_SIZE,
        )  # fmt: skip
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)  # [BH, BN]
        s = s * sm_scale_log2
        visible = n_mask
        if TREE:  # prefix keys always visible; new key j: tree_mask[b, i, j - prefix]
            rel = offs_n - pre
            m = tl.load(mask_ptr + b * stride_mb + i * stride_mq + rel, mask=n_mask & (rel >= 0), other=1)
            visible = visible & (m != 0)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, k_lat, PRECISION)
    return m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask
