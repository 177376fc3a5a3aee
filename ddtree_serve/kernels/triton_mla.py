"""Absorbed multi-head latent attention over the paged latent cache, as one Triton kernel family.

Per layer the cache holds one latent row per token, ``c = [c_kv (kv_lora_rank L) ; k_pe (rope R)]``
(ddtree_serve/model_executor/layers/mla.py). For each new token and each query head the kernel computes
``o_lat = softmax(scale * (q_lat . c_kv + q_pe . k_pe)) @ c_kv`` with ``q = [q_lat ; q_pe]`` already
absorbed (``q_lat = q_nope W_UK``), reading the cache rows in place through ``kv_indices`` (no gathered
copy) with an online softmax over ``BLOCK_N`` keys at a time (FlashAttention, Dao et al. 2022); the latent
serves as both K and V. That code (query tile, key loop) is one ``@triton.jit`` helper shared with the
split-K and DCP kernels (ddtree_serve/kernels/triton_mla_keys.py), and so is the host-side set-up
(ddtree_serve/kernels/triton_mla_launch.py).

Modes, all over the ``ForwardBatch`` metadata (ddtree_serve/model_executor/forward_batch.py):
- ``mla_decode``: one new token per request; it sees its request's ``prefix + 1`` keys.
- ``mla_extend``: prefill after a cached prefix; new token ``i`` sees ``prefix + i + 1`` keys (causal; the
  mask is implied by the lengths, ``attn_mask`` is not read).
- ``mla_verify``: target verify of a draft tree; new token ``i`` sees every prefix key and the new key
  ``prefix + j`` iff ``tree_mask[b, i, j]`` (its ancestors and itself). ``tree_mask [bs, Q, Q]`` is
  ``ForwardBatch.tree_mask``, or taken from ``attn_mask``'s new-token block when not given.

One program per (new token, ``BLOCK_H`` heads) walks all of the token's keys (decode, verify; extend runs the
query-tiled kernel of ddtree_serve/kernels/triton_mla_extend.py: ``BLOCK_M`` tokens per program); when a launch has few programs
and the context is long (small-batch decode or verify), the split-K variant (ddtree_serve/kernels/triton_mla_split.py)
splits the keys over more programs and merges them by log-sum-exp. Tiles (``BLOCK_H``, ``BLOCK_N``) and the
split count: ddtree_serve/kernels/triton_mla_plan.py (within the device's shared memory, e.g. float32 on sm120 takes
16-key tiles). Numerics:
products in the cache dtype, float32 scores, softmax and accumulation; output in the query's dtype. An fp8
cache (``--kv-cache-dtype fp8_e4m3``, format in ddtree_serve/kernels/kv_quant.py) passes its per-token scales; each key tile
is dequantized to the query's (model) dtype after its load, so products run as for a 16/32-bit cache. Runs on
CUDA, and on CPU tensors under ``TRITON_INTERPRET=1``.

Batch-invariant mode (``invariant=True`` on every entry point; ``--enable-deterministic-inference``, docs/DESIGN.md
4.18): every mode runs ddtree_serve/kernels/triton_mla_invariant.py instead (keys split at fixed positions and
merged in position order, tree nodes read at their plain-decoding positions, one tile shape for all), so a
token's output is bit-identical as a decode row, a prefill-chunk row or a tree node, whatever the batch. A
layer turns it on with ``MLA_KERNELS[mode](..., invariant=True)``; False (the default) is the kernels above.
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
    choose_kv_splits,
    device_sm_count,
    invariant_split_grid,
)
from ddtree_serve.kernels.triton_mla_split import launch_split


@triton.jit
def _mla_kernel(
    q_ptr,
    cache_ptr,
    kv_idx_ptr,
    mask_ptr,
    tok_req_ptr,
    tok_pos_ptr,
    kv_len_ptr,
    prefix_ptr,
    scale_ptr,
    out_ptr,
    sm_scale_log2,
    num_heads,
    stride_qt,
    stride_qh,
    stride_slot,
    stride_scale,
    stride_kb,
    stride_mb,
    stride_mq,
    stride_ot,
    stride_oh,
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
    b, i, n_kv, pre = mla_token(tok_req_ptr, tok_pos_ptr, kv_len_ptr, prefix_ptr, pid_t)
    m_i, l_i, acc, offs_h, h_mask, offs_l, l_mask = mla_attend(
        q_ptr, cache_ptr, kv_idx_ptr, mask_ptr, scale_ptr, pid_t, pid_h, b, i, pre, 0, n_kv, sm_scale_log2,
        num_heads, 0, stride_qt, stride_qh, stride_slot, stride_scale, stride_kb, stride_mb, stride_mq, L, R,
        TREE, FP8, PRECISION, UPCAST_DOT, BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R, 1,
    )  # fmt: skip
    out = acc / l_i[:, None]
    o = out_ptr + pid_t * stride_ot + offs_h[:, None] * stride_oh + offs_l[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_mask: torch.Tensor,
    q_index: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    tree: bool,
    tree_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
    tiles: MlaTiles | None = None,
    k_scale: torch.Tensor | None = None,
    extend: bool = False,
    invariant: bool = False,
    split_keys: int | None = None,
) -> torch.Tensor:
    """q [T, Hr, L + R] (absorbed, in the cache dtype; with an fp8 cache in the model's dtype); k_cache
    [slots, 1, L + R] -> o_lat [T, Hr, L] in q's dtype. ``k_scale`` [slots, 2] float32: the per-token
    (latent, rope) scales of an fp8 cache (ddtree_serve/kernels/kv_quant.py), None for a 16/32-bit cache.

    ``tiles``: default ``tiles_for`` the device's shared memory. ``num_splits``: key splits
    (ddtree_serve/kernels/triton_mla_split.py); default ``choose_kv_splits`` from the launch's programs, the key columns
    of ``kv_indices`` and the device's SM count (1 on CPU); 1 runs the single-pass kernel, or with ``extend``
(causal prefill) the query-tiled one (ddtree_serve/kernels/triton_mla_extend.py; ``tiles`` then sets its rows). The set-up
    (token metadata, tree mask, fp8 checks): ddtree_serve/kernels/triton_mla_launch.py.

    ``invariant``: the batch-invariant kernels (ddtree_serve/kernels/triton_mla_invariant.py): keys split at fixed
    positions every ``split_keys`` (default ``INVARIANT_SPLIT_KEYS``), tree nodes read at their plain-decoding
    positions, every mode one program per (token, head block); ``num_splits`` > 1 then only asks for the
    split grid (one program per split, same bits) and ``extend`` for nothing else."""
    t, heads, _ = q.shape
    out = torch.empty(t, heads, kv_lora_rank, dtype=q.dtype, device=q.device)  # [T, Hr, L]
    if t == 0:
        return out
    s = prepare_mla_launch(q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank,
                           scale, tree, tree_mask, k_scale, tiles, invariant)  # fmt: skip
    head_blocks = triton.cdiv(heads, s.tiles.block_h)
    if invariant:
        keys = INVARIANT_SPLIT_KEYS if split_keys is None else split_keys
        if num_splits is None:
            grid = invariant_split_grid(t * head_blocks, kv_indices.shape[1], device_sm_count(q.device.type,
                                        q.device.index), keys)  # fmt: skip
        else:
            grid = -(-kv_indices.shape[1] // keys) if num_splits > 1 else 1
        return launch_invariant(s, out, keys, grid)
    if num_splits is None:
        sms = device_sm_count(q.device.type, q.device.index)
        num_splits = choose_kv_splits(t * head_blocks, kv_indices.shape[1], sms)
    if num_splits > 1:
        return launch_split(s, out, num_splits)
    if extend:
        return launch_extend(s, extend_lens, out, tiles)
    _mla_kernel[(t, head_blocks)](
        *s.inputs(), out, s.scale_log2, heads, *s.strides(), out.stride(0), out.stride(1), **s.meta(),
    )  # fmt: skip
    return out


def mla_decode(
    q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale, tree_mask=None,
    num_splits=None, tiles=None, k_scale=None, *, invariant=False, split_keys=None,
):  # fmt: skip
    """DECODE: one new token per request (``extend_lens`` all 1). Shapes as ``_launch``; split-K when
    ``choose_kv_splits`` says so (long context, few programs) or ``num_splits`` > 1. ``tiles``: as
    ``_launch`` (tests force small ones). ``k_scale``: an fp8 cache's scales (``_launch``). ``invariant=True``:
    the batch-invariant kernels (``_launch``; ``--enable-deterministic-inference``), ``split_keys`` their
    fixed split size (default ``INVARIANT_SPLIT_KEYS``; tests use small ones)."""
    return _launch(
        q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale, False,
        num_splits=num_splits, tiles=tiles, k_scale=k_scale, invariant=invariant, split_keys=split_keys,
    )  # fmt: skip


def mla_extend(
    q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale, tree_mask=None,
    num_splits=None, tiles=None, k_scale=None, *, invariant=False, split_keys=None,
):  # fmt: skip
    """EXTEND: causal prefill of ``extend_lens[b]`` tokens after ``prefix_lens[b]`` cached ones, query-tiled
    (ddtree_serve/kernels/triton_mla_extend.py) unless split-K is chosen (few new tokens over a long prefix)."""
    return _launch(
        q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale, False,
        num_splits=num_splits, tiles=tiles, k_scale=k_scale, extend=True, invariant=invariant,
        split_keys=split_keys,
    )  # fmt: skip


def mla_verify(
    q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale, tree_mask=None,
    num_splits=None, tiles=None, k_scale=None, *, invariant=False, split_keys=None,
):  # fmt: skip
    """TARGET_VERIFY: tree nodes see the prefix and their ancestors (``tree_mask [bs, Q, Q]``, or
    ``attn_mask``'s new-token block); split-K like decode at small batch and long context."""
    return _launch(
        q, k_cache, kv_indices, attn_mask, q_index, prefix_lens, extend_lens, kv_lora_rank, scale, True,
        tree_mask, num_splits, tiles, k_scale, invariant=invariant, split_keys=split_keys,
    )  # fmt: skip


MLA_KERNELS = {"decode": mla_decode, "extend": mla_extend, "target_verify": mla_verify}
