"""The Triton MLA kernel over one rank's shard of a decode-context-parallel KV cache, returning the partial
output and its log-sum-exp (ddtree_serve/model_executor/layers/dcp_attention.py merges the DCP group's partials).

The metadata is the forward's own, over global slot ids: ``kv_indices[b, j]`` is key ``j`` of request ``b``
and global slot ``g`` lives on DCP rank ``g % N`` at local row ``g // N`` of that rank's cache. A program
walks its token's keys with the single-pass kernel's code (ddtree_serve/kernels/triton_mla_keys.py, the same set-up:
ddtree_serve/kernels/triton_mla_launch.py; decode and causal extend bound the keys by the lengths, tree verify adds
``tree_mask[b, i, j - prefix]`` for the new keys: a node sees its ancestors and itself) with the key loop's
shard filter on (``DCP_SIZE`` N): every key whose slot is another rank's is dropped before the online softmax.
The output is normalised over the local visible keys, ``lse = ln(sum exp(scale * q.k))`` over them; a token
with no local visible key gets output 0 and lse -inf. fp8 caches dequantize each tile as the main kernel
does.

Split-K (flash-decoding, ddtree_serve/kernels/triton_mla_split.py). At batch 1 the gathered heads (N x the local ones,
64 at Kimi K2.6 with DCP 8) fit one head block, so a single pass is one program per layer walking the whole
context. ``choose_dcp_kv_splits`` (ddtree_serve/kernels/triton_mla_plan.py) splits each token's key columns into chunks
when the context is long (``choose_kv_splits``'s rule over the ``K / N`` keys of the shard: 32 splits at
128k, DCP 8, 132 SMs); ``_mla_dcp_split_kernel`` walks a chunk with the shard filter on and the merge writes
the chunks' combined output and natural-log lse (a chunk with no local visible key has lse -inf and weight
0; all of them: output 0, lse -inf as above). EXTEND with no split runs the query-tiled kernel
(ddtree_serve/kernels/triton_mla_extend.py) with the same filter.

Why a filter and not a strided walk over keys ``j = r (mod N)``: placement does not guarantee that key ``j``
lives on rank ``j % N``. ``KVSlots.place`` (ddtree_serve/model_executor/kv_slots.py) asks for the rank of the token's
position, but ``ShardedSlotAllocator.alloc`` (ddtree_serve/model_executor/kv_cache.py) moves tokens that a full rank
cannot take to the emptiest ranks, and tree verify's new keys sit at column ``prefix + node`` while their
slots follow their position ``prefix + depth``. So each rank walks every column and keeps the slots
``g % N == r``: the slot ids of the other ranks' keys are read (8 B a key) but their cache rows are not
(masked loads), and the split chunks bound each program's walk.

Batch-invariant mode: ``MLA_DCP_KERNELS[mode](..., dcp_size=n, dcp_rank=r, invariant=True)`` runs
ddtree_serve/kernels/triton_mla_invariant.py with the shard filter; the rank's (o, lse) is then bit-identical
for a token alone, in a batch, in a prefill chunk or as a tree node (docs/DESIGN.md 4.18).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.kernels.triton_mla_extend import launch_extend
from ddtree_serve.kernels.triton_mla_invariant import launch_invariant
from ddtree_serve.kernels.triton_mla_keys import mla_attend, mla_token
from ddtree_serve.kernels.triton_mla_launch import prepare_mla_launch
from ddtree_serve.kernels.triton_mla_plan import (
    INVARIANT_SPLIT_KEYS,
    MlaTiles,
    choose_dcp_kv_splits,
    device_sm_count,
    invariant_split_grid,
)
from ddtree_serve.kernels.triton_mla_split import launch_split

LN2_C = tl.constexpr(0.6931471805599453)  # ln 2: the kernel's base-2 scores -> a natural-log lse


@triton.jit
def _mla_dcp_kernel(
    q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, scale_ptr, out_ptr,
    lse_ptr, sm_scale_log2, num_heads, dcp_rank, stride_qt, stride_qh, stride_slot, stride_scale, stride_kb,
    stride_mb, stride_mq, stride_ot, stride_oh, stride_lt,
    L: tl.constexpr, R: tl.constexpr, TREE: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, DCP_SIZE: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b, i, n_kv, pre = mla_token(tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, pid_t)
    m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask = mla_attend(
        q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, scale_ptr, pid_t, pid_h, b, i, pre, 0, n_kv, sm_scale_log2,
        num_heads, dcp_rank, stride_qt, stride_qh, stride_slot, stride_scale, stride_kb, stride_mb, stride_mq, L,
        R, TREE, FP8, PRECISION, UPCAST_DOT, BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R, DCP_SIZE,
    )  # fmt: skip
    seen = l_i > 0.0  # [BH] some local key is visible
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)  # [BH, BL]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2_C, float("-inf"))  # [BH] natural log
    o = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])
    tl.store(lse_ptr + pid_t * stride_lt + offs_h, lse, mask=h_mask)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, kv_indices: torch.Tensor, attn_mask: torch.Tensor,
            q_index: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, kv_lora_rank: int,
            scale: float, tree: bool, extend: bool, tree_mask: torch.Tensor | None, dcp_size: int, dcp_rank: int,
            k_scale: torch.Tensor | None = None, tiles: MlaTiles | None = None, num_splits: int | None = None,
            invariant: bool = False, split_keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, L + R] (absorbed; the DCP group's heads); k_cache [local slots + 1, 1, L + R] (this rank's
    shard); ``kv_indices`` [bs, K] global slots -> (o [T, H, L] in q's dtype, lse [T, H] float32). The
    DCP size is a constexpr of the kernels (one compile per size; the rank is a runtime argument).
    ``num_splits``: key splits (default ``choose_dcp_kv_splits``: 1 on CPU); 1 runs the single-pass kernel,
    or with ``extend`` the query-tiled one (``tiles`` then sets its rows). ``invariant``: the batch-invariant
    kernels with the shard filter (ddtree_serve/kernels/triton_mla_invariant.py; ``split_keys`` as in
    ddtree_serve/kernels/triton_mla.py ``_launch``): this rank's partial (o, lse) is then invariant."""
    t, heads, _ = q.shape
    out = torch.empty(t, heads, kv_lora_rank, dtype=q.dtype, device=q.device)  # [T, H, L]
    lse = torch.empty(t, heads, dtype=torch.float32, device=q.device)  # [T, H]
    if t == 0:
        return out, lse
    s = prepare_mla_launch(q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank,
                           scale, tree, tree_mask, k_scale, tiles, invariant)
    head_blocks = triton.cdiv(heads, s.tiles.block_h)
    if invariant:
        keys = INVARIANT_SPLIT_KEYS if split_keys is None else split_keys
        if num_splits is None:
            sms = device_sm_count(q.device.type, q.device.index)
            grid = invariant_split_grid(t * head_blocks, kv_indices.shape[1] // max(1, dcp_size), sms, keys)
            grid = -(-kv_indices.shape[1] // keys) if grid > 1 else 1
        else:
            grid = -(-kv_indices.shape[1] // keys) if num_splits > 1 else 1
        launch_invariant(s, out, keys, grid, dcp_size, dcp_rank, lse)
        return out, lse
    if num_splits is None:
        sms = device_sm_count(q.device.type, q.device.index)
        num_splits = choose_dcp_kv_splits(t * head_blocks, kv_indices.shape[1], sms, dcp_size)
    if num_splits > 1:
        launch_split(s, out, num_splits, dcp_size, dcp_rank, lse)
    elif extend:
        launch_extend(s, extend_lens, out, tiles, dcp_size, dcp_rank, lse)
    else:
        _mla_dcp_kernel[(t, head_blocks)](
            *s.inputs(), out, lse, s.scale_log2, heads, dcp_rank, *s.strides(), out.stride(0), out.stride(1),
            lse.stride(0), DCP_SIZE=dcp_size, **s.meta(),
        )  # fmt: skip
    return out, lse


def _mode(tree: bool, extend: bool):  # noqa: ANN202
    def run(q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale,
            tree_mask=None, *, dcp_size, dcp_rank, k_scale=None, tiles=None, num_splits=None, invariant=False,
            split_keys=None):  # noqa: ANN001, ANN202
        return _launch(q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale,
                       tree, extend, tree_mask if tree else None, dcp_size, dcp_rank, k_scale, tiles, num_splits,
                       invariant, split_keys)

    return run


mla_dcp_decode = _mode(False, False)  # DECODE: one new token per request, the prefix + itself
mla_dcp_extend = _mode(False, True)  # EXTEND: causal after the prefix (query-tiled)
mla_dcp_verify = _mode(True, False)  # TARGET_VERIFY: the prefix and the node's ancestors (tree_mask)

MLA_DCP_KERNELS = {"decode": mla_dcp_decode, "extend": mla_dcp_extend, "target_verify": mla_dcp_verify}
