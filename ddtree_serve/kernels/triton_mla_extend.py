"""Query-tiled EXTEND (prefill) kernel of the Triton MLA family: one program handles ``BLOCK_M`` consecutive
new tokens of one request, so each key tile is loaded once for all of them (the query tiling of
FlashAttention-2, Dao 2023) instead of once per token as in ddtree_serve/kernels/triton_mla.py's one-program-per-token
kernel, which re-reads the whole prefix for every new token of a long prefill.

Rows. A program's query tile is ``[BLOCK_ROWS, L + R]`` with row ``r`` = (token ``r // HB``, head
``pid_h * HB + r % HB``): ``HB = min(heads, BLOCK_ROWS)`` heads of ``BLOCK_M = BLOCK_ROWS // HB`` tokens
(``BLOCK_ROWS`` is the plan's ``BLOCK_H``, so the tile takes the shared memory the plan estimated for that
many heads, ddtree_serve/kernels/triton_mla_plan.py). At 8 local heads and 32 rows a program covers 4 tokens, where the
per-token kernel pads 8 heads to 16 rows; at 64 heads (DCP's gathered heads) ``BLOCK_M`` is 1 and the kernel
is the per-token one over 32 of them. (64 rows spill registers: the plan caps rows at 32.) Rows past ``BLOCK_M * HB``, past the request's last token or past the heads are
masked (query 0, never stored).

Causality: token ``i`` of request ``b`` (prefix ``P``) sees keys ``j <= P + i`` of ``kv_indices[b]``; the
program walks keys ``[0, P + i_last + 1)`` and masks ``j > P + i`` per row (only the last tiles have such
keys). Numerics, the fp8 dequantization and the DCP shard filter are the shared key tile's
(``mla_key_tile``, ddtree_serve/kernels/triton_mla_keys.py); the online softmax is ``mla_attend``'s, per row. Output:
``o [T, H, L]`` normalised over the visible keys and, for DCP (``LSE_OUT``), ``lse [T, H]`` natural log
(-inf and output 0 for a row that sees no key of this rank's shard).

Blocks. The host maps program ``k`` to (request, first token) from ``extend_lens`` on the device, without a
synchronisation: the grid is the bound ``min(T, T // BLOCK_M + bs)`` on ``sum_b ceil(extend_b / BLOCK_M)``
and the programs past the last block exit with no key. The new tokens are ``q``'s rows request after
request (``ForwardBatch``'s layout, ddtree_serve/model_executor/forward_batch.py), so ``q_index`` is not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.triton_mla_keys import mla_key_tile
from ddtree_serve.kernels.triton_mla_launch import MlaLaunch
from ddtree_serve.kernels.triton_mla_plan import MlaTiles, device_arch, device_smem_limit, tiles_for
from ddtree_serve.kernels.triton_utils import dot_args

LN2_C = tl.constexpr(0.6931471805599453)  # ln 2: base-2 scores -> a natural-log lse
EXTEND_ROWS = 32  # preferred (token, head) rows per program (the plan's most); it may shrink to fit shared memory


@triton.jit
def _mla_extend_kernel(
    q_ptr, cache_ptr, kv_idx_ptr, scale_ptr, blk_req_ptr, blk_i0_ptr, tok_start_ptr, ext_ptr, prefix_ptr, out_ptr,
    lse_ptr, sm_scale_log2, num_heads, dcp_rank, stride_qt, stride_qh, stride_slot, stride_scale, stride_kb,
    stride_ot, stride_oh, stride_lt,
    L: tl.constexpr, R: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, DCP_SIZE: tl.constexpr, LSE_OUT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.load(blk_req_ptr + pid_m).to(tl.int64)
    i0 = tl.load(blk_i0_ptr + pid_m).to(tl.int64)  # first token of the block among the request's new tokens
    pre = tl.load(prefix_ptr + b).to(tl.int64)
    n_tok = tl.minimum(tl.load(ext_ptr + b).to(tl.int64) - i0, BLOCK_M)  # tokens of this block (<= 0: none)
    hi = tl.where(n_tok > 0, pre + i0 + n_tok, 0)  # keys of the block's last token
    t0 = tl.load(tok_start_ptr + b).to(tl.int64) + i0  # flat row of the block's first token
    offs_r = tl.arange(0, BLOCK_ROWS)
    tok = offs_r // HB  # [BR] token within the block
    offs_h = pid_h * HB + offs_r % HB  # [BR] head
    row_ok = (offs_r < BLOCK_M * HB) & (tok < n_tok) & (offs_h < num_heads)  # [BR]
    lim = pre + i0 + tok + 1  # [BR] row sees keys j < lim (causal)
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < L
    offs_rr = tl.arange(0, BLOCK_R)
    r_mask = offs_rr < R
    q_row = q_ptr + (t0 + tok)[:, None] * stride_qt + offs_h[:, None] * stride_qh  # [BR, 1]
    q_lat = tl.load(q_row + offs_l[None, :], mask=row_ok[:, None] & l_mask[None, :], other=0.0)  # [BR, BL]
    q_pe = tl.load(q_row + L + offs_rr[None, :], mask=row_ok[:, None] & r_mask[None, :], other=0.0)  # [BR, BRo]
    if UPCAST_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    m_i = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_L), dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k_lat, k_pe, n_mask = mla_key_tile(
            q_ptr, cache_ptr, kv_idx_ptr, scale_ptr, b, offs_n, n_mask, offs_l, l_mask, offs_rr, r_mask, dcp_rank,
            stride_slot, stride_scale, stride_kb, L, FP8, UPCAST_DOT, DCP_SIZE,
        )  # fmt: skip
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)  # [BR, BN]
        s = s * sm_scale_log2
        visible = n_mask[None, :] & (offs_n[None, :] < lim[:, None])  # [BR, BN]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BR]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row adds nothing
        p = tl.exp2(s - m_safe[:, None])  # [BR, BN]
        alpha = tl.exp2(m_i - m_safe)  # [BR]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], input_precision=PRECISION)  # [BR, BL]
        m_i = m_new
    seen = l_i > 0.0  # [BR] some visible key (always, without DCP)
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)  # [BR, BL]
    o = out_ptr + (t0 + tok)[:, None] * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & l_mask[None, :])
    if LSE_OUT:
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2_C, float("-inf"))  # [BR]
        tl.store(lse_ptr + (t0 + tok) * stride_lt + offs_h, lse, mask=row_ok)


def extend_tiles(s: MlaLaunch) -> MlaTiles:
    """The plan's tiles for ``EXTEND_ROWS`` (token, head) rows (or the launch's heads when more): the
    preferred 32 rows shrink to 16, or the key tile to 16, where shared memory is short."""
    dev = (s.q.device.type, s.q.device.index)
    return tiles_for(max(s.heads, EXTEND_ROWS), s.lat, s.rope, s.q.dtype, device_smem_limit(*dev),
                     device_arch(*dev), s.cache.dtype if s.fp8 else None)  # fmt: skip


def extend_blocks(extend_lens: torch.Tensor, block_m: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``extend_lens [bs]`` -> (request ``[G]``, first token ``[G]`` of each block of ``block_m`` tokens,
    ``tok_start [bs]`` the flat row of each request's first token), ``G = min(t, t // block_m + bs)`` (an upper
    bound on the blocks; a block past the last has its request's ``extend_lens`` as first token: no token).
    Device ops only (no host synchronisation)."""
    bs = extend_lens.shape[0]
    ext = extend_lens.to(torch.int64)  # [bs]
    nblk = (ext + block_m - 1) // block_m  # [bs]
    cum = torch.cumsum(nblk, 0)  # [bs]
    g = min(t, t // block_m + bs)
    k = torch.arange(g, device=ext.device)  # [G]
    req = torch.searchsorted(cum, k, right=True)  # [G] in [0, bs]; bs: past the last block
    valid = req < bs
    req = req.clamp(max=bs - 1)
    i0 = torch.where(valid, (k - (cum[req] - nblk[req])) * block_m, ext[req])  # [G]
    return req, i0, torch.cumsum(ext, 0) - ext


def launch_extend(s: MlaLaunch, extend_lens: torch.Tensor, out: torch.Tensor, tiles: MlaTiles | None = None,
                  dcp_size: int = 1, dcp_rank: int = 0, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal extend of ``s`` (built with ``tree`` False) into ``out [T, H, L]``, and with ``lse_out [T, H]``
    float32 its natural-log lse. ``tiles``: the rows (``block_h``) and key tile; default ``extend_tiles``.
    ``dcp_size`` > 1: rank ``dcp_rank``'s shard of a DCP cache (global slot ids). Returns ``out``."""
    t, heads = out.shape[:2]
    tiles = extend_tiles(s) if tiles is None else tiles
    hb = min(heads, tiles.block_h)
    block_m = tiles.block_h // hb
    req, i0, tok_start = extend_blocks(extend_lens, block_m, t)  # [G], [G], [bs]
    lse = out if lse_out is None else lse_out  # [T, H] (unread without LSE_OUT)
    _mla_extend_kernel[(req.shape[0], triton.cdiv(heads, hb))](
        s.q, s.cache, s.kv_indices, s.scales, req, i0, tok_start, extend_lens, s.prefix_lens, out, lse,
        s.scale_log2, heads, dcp_rank, s.q.stride(0), s.q.stride(1), s.cache.stride(0), s.scales.stride(0),
        s.kv_indices.stride(0), out.stride(0), out.stride(1), lse.stride(0), L=s.lat, R=s.rope, FP8=s.fp8, HB=hb,
        BLOCK_M=block_m, BLOCK_ROWS=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_L=tiles.block_l,
        BLOCK_R=tiles.block_r, DCP_SIZE=dcp_size, LSE_OUT=lse_out is not None, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **dot_args(s.q.dtype),
    )  # fmt: skip
    return out
