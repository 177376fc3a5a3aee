"""The Triton MLA kernel over one rank's shard of a decode-context-parallel KV cache, returning the partial
output and its log-sum-exp (model_executor/layers/dcp_attention.py merges the DCP group's partials).

The metadata is the forward's own, over global slot ids: ``kv_indices[b, j]`` is key ``j`` of request ``b``
and global slot ``g`` lives on DCP rank ``g % N`` at local row ``g // N`` of that rank's cache. A program
walks its token's keys exactly as ``kernels/triton_mla.py``'s kernel (decode and causal extend bound the keys
by the lengths, so key ``j`` is visible to the new token at position ``prefix + i`` iff ``j <= prefix + i``;
tree verify adds ``tree_mask[b, i, j - prefix]`` for the new keys: a node sees its ancestors and itself),
and drops every key whose slot is another rank's before the online softmax. The output is normalised over
the local visible keys, ``lse = ln(sum exp(scale * q.k))`` over them; a token with no local visible key gets
output 0 and lse -inf. fp8 caches dequantize each tile as the main kernel does. One pass per token (no key
splits: under DCP every rank already walks 1/N of the keys with N times the heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_kernels.kv_quant import is_fp8
from ddtree_kernels.triton_mla_plan import MlaTiles, device_arch, device_smem_limit, tiles_for
from ddtree_kernels.triton_utils import dot_args

LOG2E = 1.4426950408889634
LN2_C = tl.constexpr(0.6931471805599453)  # ln 2: the kernel's base-2 scores -> a natural-log lse


@triton.jit
def _mla_dcp_kernel(
    q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, scale_ptr, out_ptr,
    lse_ptr, sm_scale_log2, num_heads, dcp_size, dcp_rank, stride_qt, stride_qh, stride_slot, stride_scale,
    stride_kb, stride_mb, stride_mq, stride_ot, stride_oh, stride_lt,
    L: tl.constexpr, R: tl.constexpr, TREE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.load(tok_req_ptr + pid_t).to(tl.int64)
    i = tl.load(tok_pos_ptr + pid_t).to(tl.int64)
    n_kv = tl.load(kv_len_ptr + pid_t)
    pre = tl.load(prefix_ptr + b)
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
    for start in range(0, n_kv, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_len = offs_n < n_kv
        g = tl.load(kv_idx_ptr + b * stride_kb + offs_n, mask=in_len, other=0).to(tl.int64)  # [BN] global slots
        n_mask = in_len & (g % dcp_size == dcp_rank)  # keys of this rank's shard
        slot = tl.where(n_mask, g // dcp_size, 0)  # [BN] local rows
        k_row = cache_ptr + slot[:, None] * stride_slot  # [BN, 1]
        k_lat = tl.load(k_row + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)  # [BN, BL]
        k_pe = tl.load(k_row + L + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BN, BR]
        if FP8:  # per-token (latent, rope) scales (kernels/kv_quant.py)
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
            m = tl.load(mask_ptr + b * stride_mb + i * stride_mq + rel, mask=in_len & (rel >= 0), other=1)
            visible = visible & (m != 0)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BH]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block adds nothing
        p = tl.exp2(s - m_safe[:, None])  # [BH, BN]
        alpha = tl.exp2(m_i - m_safe)  # [BH]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], input_precision=PRECISION)  # [BH, BL]
        m_i = m_new
    seen = l_i > 0.0  # [BH] some local key is visible
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)  # [BH, BL]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2_C, float("-inf"))  # [BH] natural log
    o = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])
    tl.store(lse_ptr + pid_t * stride_lt + offs_h, lse, mask=h_mask)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, kv_indices: torch.Tensor, attn_mask: torch.Tensor,
            q_index: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, kv_lora_rank: int,
            scale: float, tree: bool, tree_mask: torch.Tensor | None, dcp_size: int, dcp_rank: int,
            k_scale: torch.Tensor | None = None, tiles: MlaTiles | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, L + R] (absorbed; the DCP group's heads); k_cache [local slots + 1, 1, L + R] (this rank's
    shard); ``kv_indices`` [bs, K] global slots -> (o [T, H, L] in q's dtype, lse [T, H] float32)."""
    t, heads, width = q.shape
    lat, rope = kv_lora_rank, width - kv_lora_rank
    q_max = attn_mask.shape[1]
    tok_req = torch.div(q_index, q_max, rounding_mode="floor")  # [T]
    tok_pos = q_index - tok_req * q_max  # [T]
    kv_len = (prefix_lens + extend_lens)[tok_req] if tree else prefix_lens[tok_req] + tok_pos + 1  # [T]
    out = torch.empty(t, heads, lat, dtype=q.dtype, device=q.device)  # [T, H, L]
    lse = torch.empty(t, heads, dtype=torch.float32, device=q.device)  # [T, H]
    if t == 0:
        return out, lse
    q = q.contiguous()
    cache = k_cache.view(k_cache.shape[0], -1)  # [slots, L + R]
    if tree and tree_mask is None:  # the new-token block of attn_mask
        bs, _, k_max = attn_mask.shape
        cols = prefix_lens[:, None, None] + torch.arange(q_max, device=q.device)[None, None, :]  # [bs, 1, Q]
        tree_mask = attn_mask.gather(2, cols.clamp(max=k_max - 1).expand(bs, q_max, q_max))  # [bs, Q, Q]
    mask = tree_mask if tree else attn_mask  # unread unless tree
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    fp8 = k_scale is not None
    if fp8 != is_fp8(k_cache.dtype):
        raise ValueError("an fp8 KV cache needs its k_scale, and only an fp8 cache has one")
    scales = k_scale if fp8 else cache  # unread unless fp8
    dev = (q.device.type, q.device.index)
    if tiles is None:
        tiles = tiles_for(heads, lat, rope, q.dtype, device_smem_limit(*dev), device_arch(*dev),
                          k_cache.dtype if fp8 else None)
    _mla_dcp_kernel[(t, triton.cdiv(heads, tiles.block_h))](
        q, cache, kv_indices, mask, tok_req, tok_pos, kv_len.to(torch.int32), prefix_lens, scales, out, lse,
        scale * LOG2E, heads, dcp_size, dcp_rank, q.stride(0), q.stride(1), cache.stride(0), scales.stride(0),
        kv_indices.stride(0), mask.stride(0), mask.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        L=lat, R=rope, TREE=tree, FP8=fp8, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_L=tiles.block_l,
        BLOCK_R=tiles.block_r, num_warps=4, num_stages=tiles.num_stages, **dot_args(q.dtype),
    )  # fmt: skip
    return out, lse


def _mode(tree: bool):  # noqa: ANN202
    def run(q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale,
            tree_mask=None, *, dcp_size, dcp_rank, k_scale=None, tiles=None):  # noqa: ANN001, ANN202
        return _launch(q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale,
                       tree, tree_mask if tree else None, dcp_size, dcp_rank, k_scale, tiles)

    return run


mla_dcp_decode = _mode(False)  # DECODE: one new token per request, the prefix + itself
mla_dcp_extend = _mode(False)  # EXTEND: causal after the prefix
mla_dcp_verify = _mode(True)  # TARGET_VERIFY: the prefix and the node's ancestors (tree_mask)

MLA_DCP_KERNELS = {"decode": mla_dcp_decode, "extend": mla_dcp_extend, "target_verify": mla_dcp_verify}
