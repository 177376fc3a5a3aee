"""The host-side set-up shared by the Triton MLA launches (ddtree_serve/kernels/triton_mla.py, ddtree_serve/kernels/triton_mla_split.py,
ddtree_serve/kernels/triton_mla_dcp.py): from the ``ForwardBatch`` metadata (ddtree_serve/model_executor/forward_batch.py) each new
token's request, index and key count, the tree mask, the fp8 scales and the tiles, and the kernels' common
arguments (their signatures all open with the same inputs and strides, and take the same constexprs).

Key counts: decode and causal extend bound token ``i``'s keys by the lengths (``prefix + i + 1``: key ``j``
is visible iff ``j <= prefix + i``, ``attn_mask`` is not read); tree verify walks all ``prefix + extend``
keys of the request and the kernel filters the new ones by ``tree_mask[b, i, j - prefix]`` (``tree_mask [bs,
Q, Q]`` is ``ForwardBatch.tree_mask``, or taken from ``attn_mask``'s new-token block when not given).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_serve.kernels.kv_quant import is_fp8
from ddtree_serve.kernels.triton_mla_plan import MlaTiles, device_arch, device_smem_limit, tiles_for
from ddtree_serve.kernels.triton_utils import dot_args

LOG2E = 1.4426950408889634  # the kernels' scores are base 2


@dataclass(frozen=True)
class MlaLaunch:
    """One launch's inputs as the kernels read them (T new tokens, H heads, bs requests, Q new tokens per
    request at most, K key columns)."""

    q: torch.Tensor  # [T, H, L + R] contiguous
    cache: torch.Tensor  # [slots, L + R]
    kv_indices: torch.Tensor  # [bs, K]
    mask: torch.Tensor  # [bs, Q, Q] the tree mask (uint8 for bool); unread unless tree (then attn_mask)
    tok_req: torch.Tensor  # [T] request of each new token
    tok_pos: torch.Tensor  # [T] index among its request's new tokens
    kv_len: torch.Tensor  # [T] int32 keys of each token's range
    prefix_lens: torch.Tensor  # [bs]
    scales: torch.Tensor  # [slots, 2] float32 scales of an fp8 cache; unread unless fp8 (then cache)
    scale_log2: float  # the softmax scale times log2(e)
    lat: int  # L, the kv_lora_rank
    rope: int  # R
    tree: bool
    fp8: bool
    tiles: MlaTiles
    anc: torch.Tensor | None = None  # [bs, Q, Q] int32 (invariant tree): anc[b, i, d] = node i's ancestor at depth d

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    def inputs(self) -> tuple:
        """The kernels' leading arguments ``q_ptr .. scale_ptr``."""
        return (self.q, self.cache, self.kv_indices, self.mask, self.tok_req, self.tok_pos, self.kv_len,
                self.prefix_lens, self.scales)  # fmt: skip

    def strides(self) -> tuple[int, ...]:
        """The kernels' ``stride_qt .. stride_mq``."""
        return (self.q.stride(0), self.q.stride(1), self.cache.stride(0), self.scales.stride(0),
                self.kv_indices.stride(0), self.mask.stride(0), self.mask.stride(1))  # fmt: skip

    def meta(self) -> dict[str, object]:
        """The kernels' constexprs (``L`` .. ``BLOCK_R``) and launch options."""
        t = self.tiles
        return dict(L=self.lat, R=self.rope, TREE=self.tree, FP8=self.fp8, BLOCK_H=t.block_h, BLOCK_N=t.block_n,
                    BLOCK_L=t.block_l, BLOCK_R=t.block_r, num_warps=t.num_warps, num_stages=t.num_stages,
                    **dot_args(self.q.dtype))  # fmt: skip


def prepare_mla_launch(
    q: torch.Tensor, k_cache: torch.Tensor, kv_indices: torch.Tensor, attn_mask: torch.Tensor,
    q_index: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, kv_lora_rank: int, scale: float,
    tree: bool, tree_mask: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
    tiles: MlaTiles | None = None, invariant: bool = False,
) -> MlaLaunch:  # fmt: skip
    """q [T, H, L + R] (absorbed, in the cache dtype; with an fp8 cache in the model's dtype); k_cache
    [slots, 1, L + R]; ``k_scale`` [slots, 2] float32: the per-token (latent, rope) scales of an fp8 cache
    (ddtree_serve/kernels/kv_quant.py), None for a 16/32-bit cache (ValueError when it does not match the cache's dtype).
    ``tiles``: default ``tiles_for`` the device's shared memory. Other shapes: ``ForwardBatch``'s.
    ``invariant`` (batch-invariant mode, ddtree_serve/kernels/triton_mla_invariant.py): default tiles
    ``tiles_for(.., invariant=True)``; with ``tree`` a node's keys are its prefix then its ancestors by depth
    (``anc``, ``tree_ancestors``), ``kv_len`` = prefix + depth + 1."""
    t, heads, width = q.shape
    lat, rope = kv_lora_rank, width - kv_lora_rank
    q_max = attn_mask.shape[1]
    tok_req = torch.div(q_index, q_max, rounding_mode="floor")  # [T]
    tok_pos = q_index - tok_req * q_max  # [T]
    if tree:
        kv_len = (prefix_lens + extend_lens)[tok_req]  # [T] every key of the request, filtered by the mask
    else:
        kv_len = prefix_lens[tok_req] + tok_pos + 1  # [T] causal
    cache = k_cache.view(k_cache.shape[0], -1)  # [slots, L + R]
    if tree and tree_mask is None:  # the new-token block of attn_mask: [b, i, prefix_b + j]
        bs, _, k_max = attn_mask.shape
        cols = prefix_lens[:, None, None] + torch.arange(q_max, device=q.device)[None, None, :]  # [bs, 1, Q]
        tree_mask = attn_mask.gather(2, cols.clamp(max=k_max - 1).expand(bs, q_max, q_max))  # [bs, Q, Q]
    anc = None
    if invariant and tree:
        anc, depth = tree_ancestors(tree_mask)  # [bs, Q, Q], [bs, Q]
        kv_len = prefix_lens[tok_req] + depth[tok_req, tok_pos] + 1  # [T] the node's plain-decoding keys
    mask = tree_mask if tree else attn_mask  # unread unless tree
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    fp8 = k_scale is not None
    if fp8 and not is_fp8(k_cache.dtype):
        raise ValueError(f"k_scale is given but the cache is {k_cache.dtype}, not float8_e4m3fn")
    if is_fp8(k_cache.dtype) and not fp8:
        raise ValueError("an fp8 KV cache needs its k_scale")
    if tiles is None:
        dev = (q.device.type, q.device.index)
        tiles = tiles_for(heads, lat, rope, q.dtype, device_smem_limit(*dev), device_arch(*dev),
                          k_cache.dtype if fp8 else None, invariant)  # fmt: skip
    return MlaLaunch(
        q.contiguous(), cache, kv_indices, mask, tok_req, tok_pos, kv_len.to(torch.int32), prefix_lens,
        k_scale if fp8 else cache, scale * LOG2E, lat, rope, tree, fp8, tiles, anc,
    )  # fmt: skip


def tree_ancestors(tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_mask [bs, Q, Q] (node i sees node k: its ancestors and itself) -> (anc [bs, Q, Q] int32, depth
    [bs, Q] int64): ``depth[b, k]`` = the new keys node k sees, minus one; ``anc[b, i, depth[b, k]] = k`` for
    every k node i sees (its ancestor at each depth, itself last), 0 elsewhere. Device ops only, no host
    synchronisation (CUDA graphs); on CPU a mask that is not a tree (two visible nodes at one depth) is a
    ValueError, elsewhere it is not detected."""
    bs, q, _ = tree_mask.shape
    seen = tree_mask.to(torch.bool)  # [bs, Q, Q]
    depth = seen.sum(-1) - 1  # [bs, Q]
    at = torch.where(seen, depth[:, None, :].clamp(min=0), q)  # [bs, Q, Q] depth slot of each seen key; q: none
    node = torch.arange(q, device=tree_mask.device, dtype=torch.int32).expand(bs, q, q)  # [bs, Q, Q]
    anc = torch.zeros(bs, q, q + 1, dtype=torch.int32, device=tree_mask.device)  # column q: the discard slot
    anc.scatter_(2, at, node)
    if tree_mask.device.type == "cpu":
        filled = torch.zeros(bs, q, q + 1, dtype=torch.int64).scatter_add_(2, at, torch.ones_like(at))[..., :q]
        want = torch.arange(q)[None, None, :] <= depth[:, :, None]  # [bs, Q, Q] depths 0..depth_i, once each
        if not torch.equal(filled, want.to(torch.int64)):
            raise ValueError("invariant MLA: the tree mask is not a tree (two visible new keys share a depth)")
    return anc[..., :q].contiguous(), depth
