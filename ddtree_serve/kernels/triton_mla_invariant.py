"""Batch-invariant mode of the Triton MLA kernels (``--enable-deterministic-inference``, docs/DESIGN.md 4.18):
a new token's output depends only on its query and the keys at its context *positions*, never on the batch
beside it, whether it runs as a decode row, a prefill-chunk row or a tree node, nor on the launch plan.

Sources: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (He et al., 2025: attention with a
fixed split *size*, not a fixed split count); SGLang ``--enable-deterministic-inference`` and vLLM's batch
invariance (fixed-size KV splits for their Triton / FlashInfer decode). The tree-position part is ours: a tree
node's ancestors sit at the tree's columns behind masked siblings; here they are visited at their positions.

What the default kernels let vary, and what this mode fixes:
- split count: ``choose_kv_splits`` picks it from the batch's programs and padded key columns, and a split's
  chunk is ``ceil(n / S)`` keys. Here the keys of every token are cut at fixed positions: split ``c`` holds
  key positions ``[c * split_keys, (c + 1) * split_keys)`` (``INVARIANT_SPLIT_KEYS``, a multiple of
  ``BLOCK_N``), and each split's online softmax walks ``BLOCK_N`` tiles aligned to positions;
- merge order: the splits' partials ``(o_c, lse_c)`` are folded by one online merge in position order
  (``merge_fold``), in the merge kernel and, when one program walks every split, inside that program: so
  the plan (``invariant_split_grid``: a grid of one program per split, or one program for all) changes the
  work's layout, not a bit of the result. A split past a token's end (lse ``-inf``) folds as an exact no-op,
  so the grid's split count (from the batch's widest row) does not matter either;
- tree layout: tree verify reads node ``i``'s keys as plain decoding would see them: positions below the
  prefix at their own columns, position ``prefix + d`` at the column of its ancestor at depth ``d``
  (``anc``, ddtree_serve/kernels/triton_mla_launch.py ``tree_ancestors``), ``prefix + depth + 1`` keys in all;
- row tiling: decode, tree verify and extend all run these kernels, one program per (token, ``BLOCK_H``
  heads), with the same tiles (the query-tiled extend kernel puts (token, head) pairs in its rows: another
  tile shape). The price: a prefill chunk re-reads the prefix once per token instead of once per
  ``BLOCK_M`` tokens;
- contraction: launched with ``enable_fp_fusion=False``, so every kernel computes exactly the written
  float operations (no per-kernel choice of where a multiply-add fuses).
The DCP variant (``DCP_SIZE`` > 1) adds the shard filter (ddtree_serve/kernels/triton_mla_keys.py) and the
natural-log lse (``LSE_OUT``): a rank's partial is invariant; the merge across ranks is the layer's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.triton_mla_keys import mla_key_tile, mla_query, mla_token, online_softmax_step
from ddtree_serve.kernels.triton_mla_launch import MlaLaunch

LN2_C = tl.constexpr(0.6931471805599453)  # ln 2: base-2 scores -> a natural-log lse
MERGE_BLOCK_H = 16  # heads per merge program (elementwise over heads: any block gives the same bits)


@triton.jit
def inv_split(
    q_lat, q_pe, q_ptr, cache_ptr, kv_idx_ptr, anc_ptr, scale_ptr, b, anc_row, pre, lo, hi, sm_scale_log2,
    dcp_rank, offs_l, l_mask, offs_r, r_mask, stride_slot, stride_scale, stride_kb,
    L: tl.constexpr, TREE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, DCP_SIZE: tl.constexpr,
):  # fmt: skip
    """One split: key positions ``[lo, hi)`` (``lo`` a multiple of ``BLOCK_N``) -> ``(o [BH, BL] float32
    normalised, lse [BH] base 2)``, 0 and -inf for a head with no visible key. Position ``p`` reads column
    ``p``, or in a tree for ``p >= pre`` the column ``pre + anc[b, i, p - pre]`` (``anc_row`` = row (b, i))."""
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BN] key positions
        n_mask = offs_n < hi
        cols = offs_n
        if TREE:  # positions past the prefix: the node's ancestors by depth, then itself
            rel = offs_n - pre
            a = tl.load(anc_ptr + anc_row + rel, mask=n_mask & (rel >= 0), other=0)  # [BN]
            cols = tl.where(rel >= 0, pre + a, offs_n)
        k_lat, k_pe, n_mask = mla_key_tile(
            q_ptr, cache_ptr, kv_idx_ptr, scale_ptr, b, cols, n_mask, offs_l, l_mask, offs_r, r_mask, dcp_rank,
            stride_slot, stride_scale, stride_kb, L, FP8, UPCAST_DOT, DCP_SIZE,
        )  # fmt: skip
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)  # [BH, BN]
        s = tl.where(n_mask[None, :], s * sm_scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, k_lat, PRECISION)
    seen = l_i > 0.0  # [BH]
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BH, BL] (acc is 0 where unseen)
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BH]
    return o, lse


@triton.jit
def merge_fold(mx, tot, acc, lse_c, o_c):
    """Fold split partial ``(o_c [BH, BL], lse_c [BH])`` into the running merge ``(mx [BH] max lse, tot [BH]
    sum of 2^(lse - mx), acc [BH, BL] sum of 2^(lse - mx) o)``. A split with lse -inf is an exact no-op."""
    m_new = tl.maximum(mx, lse_c)  # [BH]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(mx - m_safe)  # [BH]
    w = tl.exp2(lse_c - m_safe)  # [BH]
    tot = tot * alpha + w
    acc = acc * alpha[:, None] + w[:, None] * o_c  # [BH, BL]
    return m_new, tot, acc


@triton.jit
def merge_store(mx, tot, acc, out_ptr, lse_out_ptr, pid_t, offs_h, h_mask, offs_l, l_mask, stride_ot, stride_oh,
                stride_et, LSE_OUT: tl.constexpr):
    """Normalise the merge and store ``o`` [BH, BL] (the output's dtype; 0 where no key was visible) and, with
    ``LSE_OUT``, the natural-log lse [BH] (-inf where none)."""
    seen = tot > 0.0  # [BH]
    out = tl.where(seen[:, None], acc / tl.where(seen, tot, 1.0)[:, None], 0.0)  # [BH, BL]
    o = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])
    if LSE_OUT:
        lse = tl.where(seen, (mx + tl.log2(tl.where(seen, tot, 1.0))) * LN2_C, float("-inf"))  # [BH]
        tl.store(lse_out_ptr + pid_t * stride_et + offs_h, lse, mask=h_mask)


@triton.jit
def _mla_inv_kernel(
    q_ptr, cache_ptr, kv_idx_ptr, anc_ptr, tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, scale_ptr, out_ptr,
    lse_ptr, o_part_ptr, sm_scale_log2, num_heads, split_keys, dcp_rank, stride_qt, stride_qh, stride_slot,
    stride_scale, stride_kb, stride_ab, stride_aq, stride_ot, stride_oh, stride_lt, stride_pt, stride_ps,
    stride_ph, stride_ls,
    L: tl.constexpr, R: tl.constexpr, TREE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DCP_SIZE: tl.constexpr, LSE_OUT: tl.constexpr, PARTIAL: tl.constexpr,
):  # fmt: skip
    """Grid (token, head block, split). ``PARTIAL`` False: one program walks all of its token's splits and
    merges them (grid split 1), storing the output (and lse). ``PARTIAL`` True: program ``pid_s`` walks split
    ``pid_s`` only and stores its partial (``o_part [T, S, H, L]``, ``lse [T, S, H]`` base 2)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b, i, n_kv, pre = mla_token(tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, pid_t)
    anc_row = b * stride_ab + i * stride_aq
    q_lat, q_pe, offs_h, h_mask, offs_l, l_mask, offs_r, r_mask = mla_query(
        q_ptr, pid_t, pid_h, num_heads, stride_qt, stride_qh, L, R, UPCAST_DOT, BLOCK_H, BLOCK_L, BLOCK_R,
    )  # fmt: skip
    if PARTIAL:
        pid_s = tl.program_id(2)
        lo = pid_s * split_keys
        o_c, lse_c = inv_split(
            q_lat, q_pe, q_ptr, cache_ptr, kv_idx_ptr, anc_ptr, scale_ptr, b, anc_row, pre, lo,
            tl.minimum(lo + split_keys, n_kv), sm_scale_log2, dcp_rank, offs_l, l_mask, offs_r, r_mask,
            stride_slot, stride_scale, stride_kb, L, TREE, FP8, PRECISION, UPCAST_DOT, BLOCK_H, BLOCK_N,
            BLOCK_L, DCP_SIZE,
        )  # fmt: skip
        o = o_part_ptr + pid_t * stride_pt + pid_s * stride_ps + offs_h[:, None] * stride_ph + offs_l[None, :]
        tl.store(o, o_c, mask=h_mask[:, None] & l_mask[None, :])
        tl.store(lse_ptr + pid_t * stride_lt + pid_s * stride_ls + offs_h, lse_c, mask=h_mask)
    else:
        mx = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        tot = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
        for lo in range(0, n_kv, split_keys):
            o_c, lse_c = inv_split(
                q_lat, q_pe, q_ptr, cache_ptr, kv_idx_ptr, anc_ptr, scale_ptr, b, anc_row, pre, lo,
                tl.minimum(lo + split_keys, n_kv), sm_scale_log2, dcp_rank, offs_l, l_mask, offs_r, r_mask,
                stride_slot, stride_scale, stride_kb, L, TREE, FP8, PRECISION, UPCAST_DOT, BLOCK_H, BLOCK_N,
                BLOCK_L, DCP_SIZE,
            )  # fmt: skip
            mx, tot, acc = merge_fold(mx, tot, acc, lse_c, o_c)
        merge_store(mx, tot, acc, out_ptr, lse_ptr, pid_t, offs_h, h_mask, offs_l, l_mask, stride_ot, stride_oh,
                    stride_lt, LSE_OUT)


@triton.jit
def _mla_inv_merge_kernel(
    o_part_ptr, lse_ptr, out_ptr, lse_out_ptr, num_heads, num_splits, stride_pt, stride_ps, stride_ph, stride_lt,
    stride_ls, stride_ot, stride_oh, stride_et,
    L: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, LSE_OUT: tl.constexpr,
):  # fmt: skip
    """Fold a token's split partials in split (position) order, the fold the single program runs."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < L
    mx = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    tot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    part = o_part_ptr + pid_t * stride_pt + offs_h[:, None] * stride_ph + offs_l[None, :]  # [BH, BL]
    for s in range(0, num_splits):
        lse_c = tl.load(lse_ptr + pid_t * stride_lt + s * stride_ls + offs_h, mask=h_mask, other=float("-inf"))
        o_c = tl.load(part + s * stride_ps, mask=h_mask[:, None] & l_mask[None, :], other=0.0)  # [BH, BL]
        mx, tot, acc = merge_fold(mx, tot, acc, lse_c, o_c)
    merge_store(mx, tot, acc, out_ptr, lse_out_ptr, pid_t, offs_h, h_mask, offs_l, l_mask, stride_ot, stride_oh,
                stride_et, LSE_OUT)


def launch_invariant(s: MlaLaunch, out: torch.Tensor, split_keys: int, grid_splits: int, dcp_size: int = 1,
                     dcp_rank: int = 0, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """The batch-invariant MLA of launch ``s`` (decode, causal extend, or tree verify with ``s.anc``) into
    ``out [T, H, L]`` and, when given, its natural-log lse into ``lse_out [T, H]``. ``split_keys``: key
    positions per split (a multiple of the tiles' ``BLOCK_N``: ValueError otherwise); ``grid_splits`` 1: one
    program per (token, head block) walks every split, else one per split (``ceil(K / split_keys)``, K the
    key columns) and a merge kernel; the two give the same bits. ``dcp_size`` > 1: rank ``dcp_rank``'s shard
    (global slot ids). Returns ``out``."""
    if split_keys <= 0 or split_keys % s.tiles.block_n:
        raise ValueError(f"split_keys must be a positive multiple of BLOCK_N {s.tiles.block_n}; got {split_keys}")
    t, heads = out.shape[:2]
    tree = s.anc is not None
    anc = s.anc if tree else s.tok_pos  # [bs, Q, Q] (unread unless tree)
    anc_strides = (anc.stride(0), anc.stride(1)) if tree else (0, 0)
    partial = grid_splits > 1
    o_part = torch.empty(t, grid_splits, heads, s.lat, dtype=torch.float32, device=out.device) if partial else out
    lse = torch.empty(t, grid_splits, heads, dtype=torch.float32, device=out.device) if partial else None
    lse_o = lse_out if lse_out is not None else out[:, :, 0]  # [T, H] (unread without LSE_OUT)
    lse_k = lse if partial else lse_o  # the first kernel's lse: partials, or the output's
    meta = s.meta()
    meta["TREE"] = tree
    _mla_inv_kernel[(t, triton.cdiv(heads, s.tiles.block_h), grid_splits)](
        s.q, s.cache, s.kv_indices, anc, s.tok_req, s.tok_pos, s.kv_len, s.prefix_lens, s.scales, out, lse_k,
        o_part, s.scale_log2, heads, split_keys, dcp_rank, s.q.stride(0), s.q.stride(1), s.cache.stride(0),
        s.scales.stride(0), s.kv_indices.stride(0), *anc_strides, out.stride(0), out.stride(1), lse_k.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_k.stride(1) if partial else 0,
        DCP_SIZE=dcp_size, LSE_OUT=lse_out is not None and not partial, PARTIAL=partial, enable_fp_fusion=False,
        **meta,
    )  # fmt: skip
    if partial:
        _mla_inv_merge_kernel[(t, triton.cdiv(heads, MERGE_BLOCK_H))](
            o_part, lse, out, lse_o, heads, grid_splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), lse_o.stride(0), L=s.lat,
            BLOCK_H=MERGE_BLOCK_H, BLOCK_L=s.tiles.block_l, LSE_OUT=lse_out is not None, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out
