"""The DFlash drafter's block attention with device-side bounds (docs/DESIGN.md 4.5, 4.17): the contract and its torch
reference, the CPU path (on CUDA the Triton kernel, ddtree_serve/kernels/triton_dflash_attention.py, runs it;
``DFlashDraftModel.forward_block`` picks).

Request ``b`` drafts a block of ``B`` queries at positions ``cached[b] .. cached[b] + B - 1``. Its keys are its
context tokens, read through the slot table (token at position ``col`` has its K/V at slot ``table[idx[b], col]``
of the drafter's paged cache, ``col < cached[b]``), then the block's own ``B`` keys, passed as tensors (never
written to the cache). One layer kind (``models/dflash_window.DraftAttention``) decides what a query sees, as
``dflash_window.visibility`` and ``windowed_batch`` do:

- ``window`` W: query at position p sees key at position k only when ``p - k < W`` (and ``k - p < W`` when not
  causal); the context keys a windowed layer reads start at ``cached - (W - 1)``;
- ``causal``: block query i sees block keys ``j <= i`` only (else the whole block);
- ``cap`` N (``--speculative-dflash-draft-window-size``): context keys at positions ``>= cached - N`` only.

Every query sees at least its own block key, so no row is empty. Scores and softmax in float32; the output is
in q's dtype. Nothing here reads a device value back or makes a value-dependent shape (the key count is the
static bound ``max_context``, the window or the cap), so a forward over it can be captured in a CUDA graph. This
module imports nothing of ours (plain tensors and ints in, as ``kernels/attention.py``).
"""

from __future__ import annotations

import torch


def context_bound(width: int, window: int | None, cap: int | None) -> int:
    """The most context keys a layer reads per request: ``width`` (the table's columns, or a tighter static bound),
    at most ``W - 1`` for a window ``W`` and ``N`` for a cap ``N``."""
    n = width
    if window is not None:
        n = min(n, window - 1)
    if cap is not None:
        n = min(n, cap)
    return max(n, 0)


def dflash_block_attention_reference(
    q: torch.Tensor,  # [bs*B, Hq, d]
    kb: torch.Tensor,  # [bs*B, Hkv, d] the block's keys
    vb: torch.Tensor,  # [bs*B, Hkv, dv]
    k_cache: torch.Tensor,  # [num_slots, Hkv, d]
    v_cache: torch.Tensor,  # [num_slots, Hkv, dv]
    table: torch.Tensor,  # [rows, C] slot of each (request row, position)
    idx: torch.Tensor,  # [bs] request rows
    cached: torch.Tensor,  # [bs] context lengths (= the block's first position)
    window: int | None,
    causal: bool,
    cap: int | None,
    scale: float,
    max_context: int | None = None,
) -> torch.Tensor:  # [bs*B, Hq, dv]
    """The contract (module docstring) in torch, over a gather of ``context_bound`` context keys per request.
    ``max_context``: a static bound on any request's context (None: the table's width)."""
    bs = idx.shape[0]
    t, hq, d = q.shape
    hkv, dv = kb.shape[1], vb.shape[2]
    blk = t // bs if bs else 0
    if bs == 0:
        return q.new_zeros(0, hq, dv)
    width = table.shape[1] if max_context is None else min(max_context, table.shape[1])
    nk = context_bound(width, window, cap)
    cached = cached.to(torch.int64)
    keep = cached  # [bs] context keys this layer reads
    for bound in (None if window is None else window - 1, cap):
        if bound is not None:
            keep = keep.clamp(max=bound)
    start = cached - keep  # [bs] first context position read
    jj = torch.arange(nk, device=q.device)  # [K]
    cols = (start[:, None] + jj[None, :]).clamp(0, max(table.shape[1] - 1, 0))  # [bs, K]
    slots = table[idx.to(torch.int64)[:, None], cols].to(torch.int64)  # [bs, K]
    ctx_ok = jj[None, :] < keep[:, None]  # [bs, K]
    slots = torch.where(ctx_ok, slots, torch.zeros_like(slots))  # padding keys read slot 0, masked below
    kc = k_cache[slots].float()  # [bs, K, Hkv, d]
    vc = v_cache[slots].float()  # [bs, K, Hkv, dv]
    keys = torch.cat([kc, kb.float().view(bs, blk, hkv, d)], 1)  # [bs, K+B, Hkv, d]
    vals = torch.cat([vc, vb.float().view(bs, blk, hkv, dv)], 1)  # [bs, K+B, Hkv, dv]
    ii = torch.arange(blk, device=q.device)  # [B]
    q_pos = cached[:, None] + ii[None, :]  # [bs, B]
    k_pos = torch.cat([start[:, None] + jj[None, :], q_pos], 1)  # [bs, K+B]
    diff = q_pos[:, :, None] - k_pos[:, None, :]  # [bs, B, K+B] query position - key position
    ok = torch.cat([ctx_ok, torch.ones(bs, blk, dtype=torch.bool, device=q.device)], 1)[:, None, :]  # [bs, 1, K+B]
    ok = ok.expand(bs, blk, nk + blk)  # [bs, B, K+B]
    if causal:
        ok = ok & (diff >= 0)  # context keys are all earlier: only later block keys are hidden
    if window is not None:
        ok = ok & (diff < window)
        if not causal:
            ok = ok & (-diff < window)
    g = hq // hkv
    qf = q.float().view(bs, blk, hkv, g, d)  # [bs, B, Hkv, G, d]
    s = torch.einsum("bikgd,bjkd->bkgij", qf, keys) * scale  # [bs, Hkv, G, B, K+B]
    s = s.masked_fill(~ok[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1)  # [bs, Hkv, G, B, K+B] (every row sees its own block key)
    out = torch.einsum("bkgij,bjkd->bikgd", p, vals)  # [bs, B, Hkv, G, dv]
    return out.reshape(t, hq, dv).to(q.dtype)

