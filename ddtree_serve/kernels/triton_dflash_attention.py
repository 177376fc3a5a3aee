"""The DFlash drafter's block attention as a Triton kernel whose work bounds come from the device (docs/DESIGN.md
4.17): the contract of ddtree_serve/kernels/dflash_attention.py (its torch reference is the CPU path), capturable
in a CUDA graph because nothing is planned on the host.

Grid ``(bs, Hkv, row tiles)``: a program takes request ``b``, KV head ``h`` and ``BLOCK_M`` of its ``B * G`` rows
(row ``r`` is block query ``r // G`` of query head ``h * G + r % G``; ``G = Hq / Hkv``, grouped heads share their
KV head's key loads). It loads ``cached[b]`` and ``idx[b]`` and walks context columns ``[lo, cached[b])`` of the
request's slot-table row in ``BLOCK_N`` tiles (K/V gathered from the paged cache by slot), then the block's own
keys from the ``kb``/``vb`` tensors in one ``BLOCK_B`` tile, folding each into an online softmax (FlashAttention,
Dao et al. 2022), base 2, float32. The loop's start is computed on the device too: 0, or for a window ``W`` the
tile's first query's window start ``cached + i0 - (W - 1)``, and with a cap ``N`` at least ``cached - N``. Per
tile the mask adds the window (``p - k < W``, and ``k - p < W`` for a non-causal layer's block keys) and block
causality (``j <= i``).

Key splits (flash-decoding): a small batch at a long context has few programs, each walking every key; with
``SPLITS`` > 1 each row tile's context range is cut, on the device, into ``SPLITS`` chunks of whole key tiles, one
program each (the block's own keys go to the first), each writing its normalised partial and log-sum-exp; the
partials are merged by ``kernels/attention.merge_attention_partials``. The number is static (chosen on the host
from the SM count and the static bound on the keys, ``triton_mla_plan.choose_kv_splits``), so a graph holds it.
Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.attention import merge_attention_partials
from ddtree_serve.kernels.dflash_attention import context_bound
from ddtree_serve.kernels.triton_mla_plan import choose_kv_splits, device_sm_count
from ddtree_serve.kernels.triton_utils import dot_args


@triton.jit
def _fold(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One key tile into the online softmax: ``s`` [BM, BN] base-2 scores (-inf where invisible), ``v`` [BN, BDV]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet adds nothing
    p = tl.exp2(s - m_safe[:, None])  # [BM, BN]
    alpha = tl.exp2(m_i - m_safe)  # [BM]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # [BM, BDV]
    return m_new, l_i, acc


@triton.jit
def _dflash_block_kernel(
    q_ptr, kb_ptr, vb_ptr, kc_ptr, vc_ptr, table_ptr, idx_ptr, cached_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_tab, stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    sm_scale_log2, window, cap,
    B: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, HAS_CAP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pid_m = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < B * G
    qi = (rows // G).to(tl.int64)  # [BM] block query index
    head = h * G + (rows % G)  # [BM] query head
    row = tl.load(idx_ptr + b).to(tl.int64)  # the request's slot-table row
    ctx = tl.load(cached_ptr + b).to(tl.int64)  # its context length = the block's first position
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    q = tl.load(q_ptr + (b * B + qi)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    p_pos = ctx + qi  # [BM] query positions
    lo = ctx * 0  # the first context column read, from the device's values
    if HAS_WINDOW:
        lo = tl.maximum(lo, ctx + (pid_m * BLOCK_M) // G - (window - 1))  # the tile's first query's window
    if HAS_CAP:
        lo = tl.maximum(lo, ctx - cap)
    hi = ctx
    if SPLITS > 1:  # this split's share of [lo, ctx), whole key tiles
        per = tl.cdiv(tl.cdiv(tl.maximum(ctx - lo, 0), SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(ctx, lo + per)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):  # context keys: the loop's bounds are device values
        cols = start + offs_n  # [BN]
        col_ok = cols < hi
        slots = tl.load(table_ptr + row * stride_tab + cols, mask=col_ok, other=0).to(tl.int64)  # [BN]
        k = tl.load(kc_ptr + slots[:, None] * stride_kcs + h * stride_kch + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [BN, BD]
        v = tl.load(vc_ptr + slots[:, None] * stride_vcs + h * stride_vch + offs_dv[None, :],
                    mask=col_ok[:, None] & dv_ok[None, :], other=0.0).to(q.dtype)  # [BN, BDV]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2  # [BM, BN]
        vis = row_ok[:, None] & col_ok[None, :]
        if HAS_WINDOW:
            vis = vis & (p_pos[:, None] - cols[None, :] < window)
        s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _fold(s, v, m_i, l_i, acc, PRECISION)
    jj = tl.arange(0, BLOCK_B)  # the block's own keys
    j_ok = jj < B
    kb = tl.load(kb_ptr + (b * B + jj)[:, None] * stride_kbt + h * stride_kbh + offs_d[None, :],
                 mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [BB, BD]
    vb = tl.load(vb_ptr + (b * B + jj)[:, None] * stride_vbt + h * stride_vbh + offs_dv[None, :],
                 mask=j_ok[:, None] & dv_ok[None, :], other=0.0).to(q.dtype)  # [BB, BDV]
    s = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * sm_scale_log2  # [BM, BB]
    diff = qi[:, None] - jj[None, :]  # [BM, BB] query position - key position
    vis = row_ok[:, None] & j_ok[None, :] & (split == 0)  # the block's keys: the first split's
    if CAUSAL:
        vis = vis & (diff >= 0)
    if HAS_WINDOW:
        vis = vis & (diff < window)
        if not CAUSAL:
            vis = vis & (-diff < window)
    s = tl.where(vis, s, float("-inf"))
    m_i, l_i, acc = _fold(s, vb, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BM, BDV] (every real row saw its own block key)
    t = b * B + qi  # [BM] token rows
    tl.store(out_ptr + split * stride_os + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    if SPLITS > 1:  # natural-log LSE of the split's scores; -inf where it saw no key
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + split * stride_ls + t * stride_lt + head, lse, mask=row_ok)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def triton_dflash_block_attention(
    q: torch.Tensor,  # [bs*B, Hq, d]
    kb: torch.Tensor,  # [bs*B, Hkv, d]
    vb: torch.Tensor,  # [bs*B, Hkv, dv]
    k_cache: torch.Tensor,  # [num_slots, Hkv, d]
    v_cache: torch.Tensor,  # [num_slots, Hkv, dv]
    table: torch.Tensor,  # [rows, C]
    idx: torch.Tensor,  # [bs]
    cached: torch.Tensor,  # [bs]
    window: int | None,
    causal: bool,
    cap: int | None,
    scale: float,
    block_n: int = 32,
    num_splits: int | None = None,
) -> torch.Tensor:  # [bs*B, Hq, dv] in q's dtype
    """``dflash_attention.dflash_block_attention_reference``'s contract as one kernel launch (two with key splits:
    the partials' merge); only shapes and the layer kind are read on the host. ``block_n``: context keys per tile
    (tests pass 16 to walk several tiles at small contexts); ``num_splits``: programs sharing one row tile's
    context keys (None: ``choose_kv_splits`` from the SM count and the static bound on the keys, so a small batch
    at a long context fills the GPU)."""
    bs = idx.shape[0]
    t, hq, d = q.shape
    hkv, dv = kb.shape[1], vb.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if window is not None and window < 1:
        raise ValueError(f"a window must be >= 1, got {window}")
    out = torch.empty(t, hq, dv, dtype=q.dtype, device=q.device)  # [bs*B, Hq, dv]
    if bs == 0 or t == 0:
        return out
    blk, g = t // bs, hq // hkv
    for name, x in (("q", q), ("kb", kb), ("vb", vb), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride in its last dimension")
    table = table if table.stride(-1) == 1 else table.contiguous()
    block_m = min(64, _pow2(blk * g))
    tiles = triton.cdiv(blk * g, block_m)
    if num_splits is None:
        keys = context_bound(table.shape[1], window, cap)
        num_splits = choose_kv_splits(bs * hkv * tiles, keys, device_sm_count(q.device.type, q.device.index))
    parts = out[None]  # [1, T, Hq, dv]
    lse = out.new_empty(1, 1, dtype=torch.float32)  # unused without splits
    if num_splits > 1:
        parts = torch.empty(num_splits, t, hq, dv, dtype=torch.float32, device=q.device)  # [S, T, Hq, dv]
        lse = torch.empty(num_splits, t, hq, dtype=torch.float32, device=q.device)  # [S, T, Hq]
    _dflash_block_kernel[(bs, hkv, tiles * num_splits)](
        q, kb, vb, k_cache, v_cache, table, idx, cached, parts, lse,
        q.stride(0), q.stride(1), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        scale * 1.4426950408889634, 0 if window is None else window, 0 if cap is None else cap,
        B=blk, G=g, D=d, DV=dv, SPLITS=num_splits, HAS_WINDOW=window is not None, CAUSAL=causal,
        HAS_CAP=cap is not None, **dot_args(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=_pow2(blk),
        BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv),
    )  # fmt: skip
    if num_splits > 1:
        out.copy_(merge_attention_partials(parts, lse))  # [T, Hq, dv]
    return out
