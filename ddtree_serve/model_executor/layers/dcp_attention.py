"""Decode context parallelism (DCP) for MLA's latent attention: each rank of a DCP group of N ranks holds 1/N of
every sequence's latent KV and attention over the whole sequence is the log-sum-exp merge of the ranks'
partials (docs/DESIGN.md, "Decode context parallelism"; the method of vLLM's ``decode_context_parallel_size``).

Layout: a forward's slot ids (``out_cache_loc``, ``kv_indices``) are global; global slot ``g`` is local slot
``g // N`` of DCP rank ``g % N`` (ddtree_serve/model_executor/kv_cache.py, ``ShardedSlotAllocator``). The metadata is the same
on every rank, so the masks keep their meaning: column ``j`` of ``kv_indices`` is still the request's key ``j``
(the key at position ``j`` for EXTEND/DECODE, ``prefix + node`` for a tree), and a rank only drops the columns
whose slot is not its own.

One MLA layer under DCP (``dcp_latent_attention``):
1. every rank computes the latent of every new token and writes the ones whose slot is its own
   (``local_cache_loc``: the others go to the rank's padding slot 0, never read as a visible key);
2. the absorbed queries of the group's ranks are all-gathered over the heads: ``[T, Hr, W] -> [T, N*Hr, W]``
   (rank ``d``'s heads at block ``d``);
3. each rank attends with every gathered head over its own keys, returning the partial output and its
   log-sum-exp (a row without a local key: output 0, lse -inf);
4. ``dcp_merge``: the lse are all-gathered, each rank weights its partial by ``exp(lse_d - lse)`` and a
   reduce-scatter over the heads sums the weighted partials and hands each rank its own ``Hr`` heads.
Every query sees at least one key on some rank (itself; a padded row sees the padding key 0 of rank 0), so
the merged softmax is normalised.

Under ``--enable-deterministic-inference`` (``dcp_invariant_latent_attention``, docs/DESIGN.md 4.18) step 3 runs
the position-split attention (ddtree_serve/kernels/mla_invariant.py) over the rank's own keys, giving each
query's unnormalised total and its local max score, and step 4 becomes ``dcp_merge_ordered``: the ranks'
totals are all-gathered, rescaled to the group's max (a max is exact) and summed in DCP-rank order, then
normalised. A token's slot lives on the DCP rank of its position (``ShardedSlotAllocator``; tree nodes too),
so which keys a rank holds, and so each rank's partial, depends on positions only: a row's result is the same
in a tree, a batch or a chunk. Only a full rank's overflow (a token moved to another rank) changes the rounding.
"""

from __future__ import annotations

import torch

from ddtree_serve.kernels.attention import masked_paged_attention_lse
from ddtree_serve.kernels.batch_invariant import normalize_totals
from ddtree_serve.kernels.kv_quant import read_latent
from ddtree_serve.kernels.mla_invariant import invariant_latent_totals
from ddtree_serve.model_executor.forward_batch import ForwardBatch
from ddtree_serve.model_executor.parallel_state import TPGroup


def local_cache_loc(loc: torch.Tensor, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """Global slots ``[T]`` -> this DCP rank's local slots ``[T]``; a slot of another rank maps to the padding
    slot 0 (written, never read as a visible key)."""
    return torch.where(loc % dcp_size == dcp_rank, torch.div(loc, dcp_size, rounding_mode="floor"), 0)


def shard_keys(kv_indices: torch.Tensor, dcp_size: int, dcp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ``kv_indices [bs, K]`` -> (local indices ``[bs, K]``, 0 where not local; ``mine [bs, K]`` bool:
    the key lives on this DCP rank)."""
    mine = kv_indices % dcp_size == dcp_rank  # [bs, K]
    return torch.where(mine, torch.div(kv_indices, dcp_size, rounding_mode="floor"), 0), mine


def dcp_merge(out: torch.Tensor, lse: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The group's partials -> this rank's heads. ``out`` [T, N*Hr, W] (this rank's partial for every gathered
    head), ``lse`` [T, N*Hr] float32 -> [T, Hr, W] float32, the exact softmax over the union of the shards."""
    every = tp.dcp_all_gather(lse[None].float(), dim=0)  # [N, T, N*Hr]
    total = torch.logsumexp(every, dim=0)  # [T, N*Hr]
    w = torch.exp(lse.float() - torch.where(torch.isfinite(total), total, 0.0))  # [T, N*Hr] (0 for -inf)
    return tp.dcp_reduce_scatter(out.float() * w[..., None], dim=1)  # [T, Hr, W]


def dcp_latent_attention(q: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                         kv_lora_rank: int, scale: float, backend: str, tp: TPGroup) -> torch.Tensor:
    """Absorbed MLA attention of this rank's heads over the whole sequence, its KV sharded over the DCP group.
    q [T, Hr, kv_lora + rope] (in the dtype of the products); k_cache [local slots + 1, 1, kv_lora + rope]
    already holds this step's local keys -> o_lat [T, Hr, kv_lora] in q's dtype."""
    n, r = tp.dcp_size, tp.dcp_rank
    qg = tp.dcp_all_gather(q, dim=1)  # [T, N*Hr, W]
    if backend == "triton":
        from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS

        o, lse = MLA_DCP_KERNELS[fb.mode.value](qg, k_cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens,
                                                fb.extend_lens, kv_lora_rank, scale, fb.tree_mask, dcp_size=n,
                                                dcp_rank=r, k_scale=k_scale)  # [T, N*Hr, L], [T, N*Hr]
    else:
        local, mine = shard_keys(fb.kv_indices, n, r)  # [bs, K] each
        mask = fb.attn_mask & mine[:, None, :]  # [bs, Q, K]: the visible keys that live here
        if k_scale is None:
            o, lse = masked_paged_attention_lse(qg, k_cache, k_cache[..., :kv_lora_rank], local, mask, fb.q_index,
                                                scale)
        else:  # fp8: dequantize the gathered local rows, then the same reference over them
            bs, kmax = local.shape
            lat = read_latent(k_cache, k_scale, local.reshape(-1), kv_lora_rank, q.dtype)  # [bs*K, 1, W]
            idx = torch.arange(bs * kmax, device=q.device).view(bs, kmax)  # rows of the gathered copy
            o, lse = masked_paged_attention_lse(qg, lat, lat[..., :kv_lora_rank], idx, mask, fb.q_index, scale)
    return dcp_merge(o, lse, tp).to(q.dtype)


def merge_totals_ordered(totals: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
    """The ranks' unnormalised partials of the same queries merged in rank order: ``totals`` [N, T, H, L + 1]
    float32 (numerator ; denominator over rank d's keys, relative to ``maxes[d]``), ``maxes`` [N, T, H] (-inf
    where rank d holds no visible key) -> [T, H, L] float32. Each partial is rescaled to the ranks' max (exact)
    and they are summed d = 0, 1, ..., N - 1, then normalised."""
    top = maxes.amax(0)  # [T, H], exact
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.where(torch.isfinite(maxes), torch.exp(maxes - top), torch.zeros_like(maxes))  # [N, T, H]
    acc = totals[0] * w[0, ..., None]  # [T, H, L + 1]
    for d in range(1, totals.shape[0]):  # rank order
        acc = acc + totals[d] * w[d, ..., None]
    return normalize_totals(acc)


def dcp_merge_ordered(total: torch.Tensor, m: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``merge_totals_ordered`` of this rank's heads over the DCP group: ``total`` [T, N*Hr, L + 1], ``m``
    [T, N*Hr] float32 (this rank's partial for every gathered head) -> [T, Hr, L] float32."""
    hr = total.shape[1] // tp.dcp_size
    mine = slice(tp.dcp_rank * hr, (tp.dcp_rank + 1) * hr)
    maxes = tp.dcp_all_gather(m[None, :, mine].contiguous(), dim=0)  # [N, T, Hr]
    totals = tp.dcp_all_gather(total[None, :, mine].contiguous(), dim=0)  # [N, T, Hr, L + 1]
    return merge_totals_ordered(totals, maxes)


def dcp_invariant_latent_attention(q: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor,
                                   k_scale: torch.Tensor | None, kv_lora_rank: int, scale: float, tp: TPGroup,
                                   backend: str = "torch") -> torch.Tensor:
    """``dcp_latent_attention`` made row-invariant (module docstring): q [T, Hr, kv_lora + rope] -> o_lat
    [T, Hr, kv_lora] in q's dtype. ``backend`` "triton": the rank's partial from the Triton DCP kernel's invariant
    mode (o normalised, natural-log lse), taken as the total ``[o, 1]`` relative to ``m = lse``."""
    qg = tp.dcp_all_gather(q, dim=1)  # [T, N*Hr, W]
    if backend == "triton":
        from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS

        o, lse = MLA_DCP_KERNELS[fb.mode.value](qg, k_cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens,
                                                fb.extend_lens, kv_lora_rank, scale, fb.tree_mask, dcp_size=tp.dcp_size,
                                                dcp_rank=tp.dcp_rank, k_scale=k_scale, invariant=True)
        seen = torch.isfinite(lse)[..., None]  # [T, N*Hr, 1]: the rank holds a visible key
        total = torch.cat([o.float(), torch.ones_like(lse)[..., None]], dim=-1) * seen  # [T, N*Hr, L + 1]
        return dcp_merge_ordered(total, lse.float(), tp).to(q.dtype)
    local, mine = shard_keys(fb.kv_indices, tp.dcp_size, tp.dcp_rank)  # [bs, K] each
    total, m = invariant_latent_totals(qg, k_cache, k_scale, fb.attention_meta(), kv_lora_rank, scale, key_ok=mine,
                                       kv_indices=local)  # [T, N*Hr, L + 1], [T, N*Hr]
    return dcp_merge_ordered(total, m, tp).to(q.dtype)
