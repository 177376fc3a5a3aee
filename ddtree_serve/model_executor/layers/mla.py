"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2.x) over a latent-only paged KV cache.

Per token and layer the cache holds ``c = [kv_a_layernorm(c_kv) (kv_lora_rank) ; rope(k_pe) (qk_rope_head_dim)]``
(512 + 64 for Kimi), one "head" shared by every query head and every TP rank (the latent is replicated).

Every mode (EXTEND, DECODE, TARGET_VERIFY) uses the absorbed form over that cache, with exactly the
ForwardBatch metadata (kv_indices / attn_mask / q_index):
  q_lat[h] = q_nope[h] @ W_UK[h]              [T, Hr, kv_lora]    (W_UK = kv_b_proj rows of k_nope)
  score    = (q_lat . c_kv + q_pe . k_pe) * scale
  o_lat    = softmax(score) @ c_kv            [T, Hr, kv_lora]
  o[h]     = o_lat[h] @ W_UV[h]^T             [T, Hr, v_head_dim]
which equals the expanded form (k = [c_kv W_UK^T ; k_pe], v = c_kv W_UV^T) in exact arithmetic
(``forward_expanded`` is kept as the check). The cache is the model's dtype, bfloat16, or float8_e4m3fn with
per-token scales (``--kv-cache-dtype``, ddtree_serve/kernels/kv_quant.py: written quantized, read dequantized). Backends: "torch" runs ``masked_paged_attention``; "triton"
runs ddtree_serve/kernels/triton_mla.py (decode / extend / target-verify kernels over the same metadata). Prefill uses the absorbed form too: on the reference path it
costs more FLOPs than expanding but needs no second code path; a CUDA prefill may switch to the expanded
form (ragged FA over k/v built from the same latent) without changing the cache.

Decode context parallelism (``tp.dcp_size`` N > 1, ``--decode-context-parallel-size``): the cache of a rank
holds only the tokens whose (global) slot is its own, 1/N of every sequence; the latent attention then runs
over the shard for the DCP group's heads and the partials are merged by log-sum-exp
(ddtree_serve/model_executor/layers/dcp_attention.py). Projections and the absorbed weights are unchanged.

Softmax scale: ``(qk_nope + qk_rope) ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` when
rope scaling is on and ``mscale_all_dim`` is set (transformers ``yarn_apply_mscale``). RoPE applies to the
``qk_rope_head_dim`` part only; ``rope_interleave`` (transformers default True) rotates adjacent pairs
(GPT-J style), else rotate-half. Our interleaved rotation keeps pairs in place where transformers
de-interleaves its output; q and k get the same permutation, so scores are identical.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ddtree_serve.kernels.attention import masked_paged_attention
from ddtree_serve.kernels.kv_quant import read_latent, write_latent
from ddtree_serve.kernels.mla_invariant import absorb_queries, expand_values, invariant_latent_attention
from ddtree_serve.model_executor.forward_batch import ForwardBatch
from ddtree_serve.model_executor.layers.dcp_attention import (
    dcp_invariant_latent_attention,
    dcp_latent_attention,
    local_cache_loc,
)
from ddtree_serve.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from ddtree_serve.model_executor.layers.norm import RMSNorm
from ddtree_serve.model_executor.layers.rotary import RotaryEmbedding
from ddtree_serve.model_executor.model_config import rope_parameters
from ddtree_serve.model_executor.parallel_state import TPGroup


def mla_softmax_scale(cfg: dict) -> float:
    """transformers' DeepseekV3Attention.scaling for an HF text config dict."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rp = rope_parameters(cfg)
    mscale_all_dim = rp.get("mscale_all_dim") or 0
    if rp.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = float(rp["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """Checkpoint names: q_a_proj, q_a_layernorm, q_b_proj (or q_proj without q_lora), kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj. Heads are split across TP ranks; q_a/kv_a are replicated.
    ``row_invariant`` (``--enable-deterministic-inference``, set per instance by ``use_invariant_linears``): the
    absorption GEMMs run ddtree_serve/kernels/mla_invariant.py, the latent attention its torch path ("torch") or
    the Triton kernels' invariant mode ("triton")."""

    row_invariant = False

    def __init__(self, cfg: dict, layer_id: int, tp: TPGroup, dtype: torch.dtype, backend: str = "torch"):
        """``backend``: the latent attention's kernels, "torch" (``masked_paged_attention`` over a padded
        gather, every device) or "triton" (ddtree_serve/kernels/triton_mla.py, reading the cache in place)."""
        super().__init__()
        self.backend = backend
        self.tp = tp  # DCP collectives (tp.dcp_size > 1)
        hidden = cfg["hidden_size"]  # q_a/kv_a layernorms use eps 1e-6 (transformers and DeepSeek code)
        bias = bool(cfg.get("attention_bias", False))
        self.layer_id = layer_id
        self.n_heads = cfg["num_attention_heads"]
        self.local_heads = tp.shard(self.n_heads, "attention heads")
        self.q_lora_rank = cfg.get("q_lora_rank")
        self.kv_lora_rank = cfg["kv_lora_rank"]
        self.nope, self.rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim = cfg["v_head_dim"]
        self.qk_dim = self.nope + self.rope
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [self.n_heads * self.qk_dim], False, tp, dtype)
        else:
            self.q_proj = ColumnParallelLinear(hidden, [self.n_heads * self.qk_dim], False, tp, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [self.n_heads * (self.nope + self.v_dim)], False,
                                              tp, dtype)
        self.o_proj = RowParallelLinear(self.n_heads * self.v_dim, hidden, bias, tp, dtype)
        interleave = bool(cfg.get("rope_interleave", True))
        self.rotary = RotaryEmbedding(self.rope, rope_parameters(cfg), cfg.get("max_position_embeddings", 4096),
                                      is_neox_style=not interleave)
        self.scale = mla_softmax_scale(cfg)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope

    def _project(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, H] -> q_nope [T, Hr, nope], q_pe [T, Hr, rope] (rotated), latent [T, 1, kv_lora + rope]."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))) if self.q_lora_rank else self.q_proj(h)
        q = q.view(-1, self.local_heads, self.qk_dim)  # [T, Hr, nope + rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(h).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, kv_lora]
        q_pe = self.rotary.apply(q_pe, *cos_sin)  # [T, Hr, rope]
        k_pe = self.rotary.apply(k_pe[:, None, :], *cos_sin)  # [T, 1, rope]
        return q_nope, q_pe, torch.cat([c_kv[:, None, :], k_pe], dim=-1)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj.weight [Hr*(nope+v), kv_lora] -> W_UK [Hr, nope, kv_lora], W_UV [Hr, v, kv_lora]."""
        w = self.kv_b_proj.weight.view(self.local_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, h: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], k_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Absorbed MLA. h [T, H]; k_cache [slots, 1, kv_lora + rope] (written at fb.out_cache_loc) -> [T, H].
        ``k_scale`` [slots, 2]: the per-token scales of an fp8 cache (ddtree_serve/kernels/kv_quant.py), else None; an fp8
        cache is written quantized and read dequantized into the model's dtype."""
        q_nope, q_pe, latent = self._project(h, cos_sin)
        dcp = self.tp.dcp_size > 1
        loc = local_cache_loc(fb.out_cache_loc, self.tp.dcp_size, self.tp.dcp_rank) if dcp else fb.out_cache_loc
        write_latent(k_cache, k_scale, loc, latent, self.kv_lora_rank)  # DCP: this rank's tokens only
        w_uk, w_uv = self._w_uk_uv()
        if self.row_invariant:
            q_lat = absorb_queries(q_nope, w_uk)  # [T, Hr, kv_lora]
        else:
            q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, Hr, kv_lora]
        cdt = h.dtype if k_scale is not None else k_cache.dtype  # dtype of the products
        q_full = torch.cat([q_lat, q_pe], dim=-1).to(cdt)  # [T, Hr, kv_lora + rope]
        if self.row_invariant:
            if dcp:
                o_lat = dcp_invariant_latent_attention(q_full, fb, k_cache, k_scale, self.kv_lora_rank, self.scale,
                                                       self.tp, self.backend)  # [T, Hr, kv_lora]
            elif self.backend == "triton":  # the Triton kernels' batch-invariant mode
                from ddtree_serve.kernels.triton_mla import MLA_KERNELS

                o_lat = MLA_KERNELS[fb.mode.value](q_full, k_cache, fb.kv_indices, fb.attn_mask, fb.q_index,
                                                   fb.prefix_lens, fb.extend_lens, self.kv_lora_rank, self.scale,
                                                   fb.tree_mask, k_scale=k_scale, invariant=True)  # [T, Hr, kv_lora]
            else:
                o_lat = invariant_latent_attention(q_full, k_cache, k_scale, fb.attention_meta(), self.kv_lora_rank,
                                                   self.scale)  # [T, Hr, kv_lora]
            o = expand_values(o_lat.to(w_uv.dtype), w_uv)  # [T, Hr, v]
            return self.o_proj(o.reshape(o.shape[0], -1))
        if dcp:
            o_lat = dcp_latent_attention(q_full, fb, k_cache, k_scale, self.kv_lora_rank, self.scale, self.backend,
                                         self.tp)  # [T, Hr, kv_lora]
        elif self.backend == "triton":
            from ddtree_serve.kernels.triton_mla import MLA_KERNELS

            o_lat = MLA_KERNELS[fb.mode.value](q_full, k_cache, fb.kv_indices, fb.attn_mask, fb.q_index,
                                               fb.prefix_lens, fb.extend_lens, self.kv_lora_rank, self.scale,
                                               fb.tree_mask, k_scale=k_scale)  # [T, Hr, kv_lora]
        elif k_scale is None:
            v_view = k_cache[..., : self.kv_lora_rank]  # [slots, 1, kv_lora]: the latent doubles as V
            o_lat = masked_paged_attention(q_full, k_cache, v_view, fb.kv_indices, fb.attn_mask, fb.q_index,
                                           self.scale)  # [T, Hr, kv_lora]
        else:  # fp8: dequantize each request's gathered rows, then the same reference over them
            bs, kmax = fb.kv_indices.shape
            lat = read_latent(k_cache, k_scale, fb.kv_indices.reshape(-1), self.kv_lora_rank, cdt)  # [bs*K, 1, W]
            idx = torch.arange(bs * kmax, device=h.device).view(bs, kmax)  # rows of the gathered copy
            o_lat = masked_paged_attention(q_full, lat, lat[..., : self.kv_lora_rank], idx, fb.attn_mask,
                                           fb.q_index, self.scale)  # [T, Hr, kv_lora]
        o = torch.einsum("thl,hvl->thv", o_lat.to(w_uv.dtype), w_uv)  # [T, Hr, v]
        return self.o_proj(o.reshape(o.shape[0], -1))

    def forward_expanded(self, h: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor,
                         cos_sin: tuple[torch.Tensor, torch.Tensor], k_scale: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """Reference: same cache write, then per-head K/V expanded from each request's gathered latent (an
        unsharded cache: no DCP)."""
        if self.tp.dcp_size > 1:
            raise ValueError("forward_expanded reads an unsharded cache; decode context parallelism runs forward")
        q_nope, q_pe, latent = self._project(h, cos_sin)
        write_latent(k_cache, k_scale, fb.out_cache_loc, latent, self.kv_lora_rank)
        bs, kmax = fb.kv_indices.shape
        lat = read_latent(k_cache, k_scale, fb.kv_indices.reshape(-1), self.kv_lora_rank, h.dtype)[:, 0]
        # lat [bs*K, kv_lora + rope]
        c_kv, k_pe = lat.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(-1, self.local_heads, self.nope + self.v_dim)  # [bs*K, Hr, nope + v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.local_heads, -1)], dim=-1)  # [bs*K, Hr, qk]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, Hr, qk]
        idx = torch.arange(bs * kmax, device=h.device).view(bs, kmax)  # rows of the expanded "cache"
        o = masked_paged_attention(q, k, v, idx, fb.attn_mask, fb.q_index, self.scale)  # [T, Hr, v]
        return self.o_proj(o.reshape(o.shape[0], -1))
