"""Attention over a paged (token-granular) KV cache with an explicit per-request mask.

One interface, several backends. A backend is called per layer with the new tokens' q/k/v (flat over the
batch) and the metadata of ``ddtree_serve.model_executor.forward_batch.ForwardBatch`` (passed as plain tensors so this
package imports nothing of ours): it writes k/v into the cache slots ``out_cache_loc`` and returns the
attention output for every new token. The torch reference (SDPA over a padded gather) runs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMeta:
    """What every layer of one forward shares: ``ForwardBatch``'s attention metadata as plain tensors.

    ``causal``: the mask is "whole prefix + causal among the new tokens" (EXTEND/DECODE), so a backend
    may use a causal kernel and ignore ``attn_mask``; False: ``attn_mask`` is arbitrary (tree
    verification, drafter blocks) and must be applied as given. ``decode``: every request adds exactly
    one token. ``prefix_lens``/``extend_lens`` [bs] int64: keys of request b are the first
    ``prefix_lens[b] + extend_lens[b]`` columns of ``kv_indices[b]``, its queries the first
    ``extend_lens[b]`` padded rows.
    """

    causal: bool
    decode: bool
    kv_indices: torch.Tensor  # [bs, K]
    attn_mask: torch.Tensor  # [bs, Q, K] bool
    q_index: torch.Tensor  # [T]
    prefix_lens: torch.Tensor  # [bs]
    extend_lens: torch.Tensor  # [bs]

    def describes(self, kv_indices: torch.Tensor, attn_mask: torch.Tensor, q_index: torch.Tensor) -> bool:
        """True when a layer's metadata tensors are this forward's (the same objects)."""
        return kv_indices is self.kv_indices and attn_mask is self.attn_mask and q_index is self.q_index


class AttentionBackend(Protocol):
    def begin_forward(self, meta: AttentionMeta) -> None:
        """Called once per model forward, before its first layer: drops any plan of an earlier forward
        (the caller owns the step; nothing is inferred from tensor versions)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, d]
        k: torch.Tensor,  # [T, Hkv, d]
        v: torch.Tensor,  # [T, Hkv, dv]
        k_cache: torch.Tensor,  # [num_slots, Hkv, d]
        v_cache: torch.Tensor,  # [num_slots, Hkv, dv]
        out_cache_loc: torch.Tensor,  # [T]
        kv_indices: torch.Tensor,  # [bs, K]
        attn_mask: torch.Tensor,  # [bs, Q, K] bool
        q_index: torch.Tensor,  # [T]
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, dv]
        ...


def masked_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_mask: torch.Tensor,
    q_index: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference attention for already-written caches. q [T, Hq, d] -> [T, Hq, dv]. Needs the dense mask: a
    ``[bs, Q, 1]`` placeholder (ddtree_serve/model_executor/forward_batch.py, ``dense_mask=False``) would broadcast to
    "every key visible", so it is refused."""
    bs, q_max, k_width = attn_mask.shape
    if k_width != kv_indices.shape[1]:
        raise ValueError(f"attention needs the dense [bs, Q, K] mask, got {tuple(attn_mask.shape)} for "
                         f"{kv_indices.shape[1]} keys (a forward batch built with dense_mask=False)")
    t, hq, d = q.shape
    qp = q.new_zeros(bs * q_max, hq, d)  # [bs*Q, Hq, d]
    qp[q_index] = q
    qp = qp.view(bs, q_max, hq, d).transpose(1, 2)  # [bs, Hq, Q, d]
    kp = k_cache[kv_indices].to(q.dtype).transpose(1, 2)  # [bs, Hkv, K, d] (a bfloat16 cache under float32)
    vp = v_cache[kv_indices].to(q.dtype).transpose(1, 2)  # [bs, Hkv, K, dv]
    out = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=attn_mask[:, None], scale=scale, enable_gqa=kp.shape[1] != hq
    )  # [bs, Hq, Q, dv]
    return out.transpose(1, 2).reshape(bs * q_max, hq, -1)[q_index]


def masked_paged_attention_lse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_mask: torch.Tensor,
    q_index: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``masked_paged_attention`` that also returns each row's log-sum-exp of its scaled scores, for a partial
    over a subset of the keys (decode context parallelism: the keys of one rank's KV shard). q [T, Hq, d]
    -> (out [T, Hq, dv] in q's dtype, lse [T, Hq] float32). A row that sees no key here gets out 0 and lse
    -inf (it adds nothing to ``merge_attention_partials``). Scores and softmax in float32."""
    bs, q_max, k_width = attn_mask.shape
    if k_width != kv_indices.shape[1]:
        raise ValueError(f"attention needs the dense [bs, Q, K] mask, got {tuple(attn_mask.shape)} for "
                         f"{kv_indices.shape[1]} keys")
    t, hq, d = q.shape
    qp = q.new_zeros(bs * q_max, hq, d)  # [bs*Q, Hq, d]
    qp[q_index] = q
    qp = qp.view(bs, q_max, hq, d).transpose(1, 2).float()  # [bs, Hq, Q, d]
    kp = k_cache[kv_indices].float().transpose(1, 2)  # [bs, Hkv, K, d]
    vp = v_cache[kv_indices].float().transpose(1, 2)  # [bs, Hkv, K, dv]
    if kp.shape[1] != hq:  # grouped heads: each KV head serves hq / Hkv query heads
        kp = kp.repeat_interleave(hq // kp.shape[1], dim=1)
        vp = vp.repeat_interleave(hq // vp.shape[1], dim=1)
    s = torch.matmul(qp, kp.transpose(-1, -2)) * scale  # [bs, Hq, Q, K]
    s = s.masked_fill(~attn_mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [bs, Hq, Q]
    seen = torch.isfinite(lse)  # [bs, Hq, Q]
    p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])  # [bs, Hq, Q, K] (0 where masked)
    out = torch.matmul(p, vp)  # [bs, Hq, Q, dv]
    out = out.transpose(1, 2).reshape(bs * q_max, hq, -1)[q_index]  # [T, Hq, dv]
    lse = lse.transpose(1, 2).reshape(bs * q_max, hq)[q_index]  # [T, Hq]
    return out.to(q.dtype), lse


def merge_attention_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention over the union of disjoint key sets from per-set partials: ``outs`` [P, T, H, dv]
    (each normalised over its own keys), ``lses`` [P, T, H] (their log-sum-exps, -inf for an empty set)
    -> [T, H, dv] float32, ``sum_p exp(lse_p - lse) out_p`` with ``lse = logsumexp_p lse_p``. A row empty
    in every part is 0."""
    total = torch.logsumexp(lses.float(), dim=0)  # [T, H]
    w = torch.exp(lses.float() - torch.where(torch.isfinite(total), total, 0.0)[None])  # [P, T, H]
    return (outs.float() * w[..., None]).sum(0)


class TorchAttentionBackend:
    """SDPA over a padded gather of each request's keys; the contract every backend must match."""

    def begin_forward(self, meta: AttentionMeta) -> None:
        """Nothing to plan: every call reads its mask directly."""

    def forward(self, q, k, v, k_cache, v_cache, out_cache_loc, kv_indices, attn_mask, q_index, scale):
        k_cache[out_cache_loc] = k.to(k_cache.dtype)
        v_cache[out_cache_loc] = v.to(v_cache.dtype)
        return masked_paged_attention(q, k_cache, v_cache, kv_indices, attn_mask, q_index, scale)
