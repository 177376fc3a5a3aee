"""Batch-invariant multi-head latent attention (``--enable-deterministic-inference``; DeepSeek-V3 / Kimi K2.x).

The absorbed MLA of ddtree_serve/model_executor/layers/mla.py with every reduction fixed by the row's own data:
a query's latent output depends on its own absorbed query and the latents at its context *positions* only,
never on how many tokens run beside it, whether it is a decode row, a prefill-chunk row or a tree node, or
whether its prefix came from the prefix cache. So, with the row-invariant linears, a token's logits are the
same bits in a DDTree verify forward as in plain decoding (docs/DESIGN.md 4.18).

- Absorption (``absorb_queries``, ``expand_values``): the per-head products ``q_nope W_UK`` and
  ``o_lat W_UV^T`` as batched GEMMs over the heads whose row count is padded to whole ``ROW_BLOCK``s
  (``row_block_matmul``): the library then computes a row the same way for any number of tokens.
- Attention: MLA over its latent cache is multi-query attention with one KV "head" of width
  ``kv_lora + rope`` whose first ``kv_lora`` columns double as V, so it runs the position-split attention of
  ddtree_serve/kernels/attention_invariant.py (keys in fixed splits of ``KV_SPLIT`` positions, fixed GEMM item
  shapes, the splits summed in position order; a tree node's ancestors gathered back to their positions).
  An fp8 cache (ddtree_serve/kernels/kv_quant.py) is first dequantized row by row into a gathered copy (a
  token's dequantized latent depends on its own row and scale only).
- Decode context parallelism: ``invariant_latent_totals`` gives a rank's unnormalised partial over the keys
  it holds; ddtree_serve/model_executor/layers/dcp_attention.py merges the ranks' partials in rank order.

Sources: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (He et al., 2025: batch-invariant
matmul and attention with a fixed split size); SGLang ``--enable-deterministic-inference`` and vLLM's
batch-invariant mode. Scores and softmax in float32. No module-level mutable state.
"""

from __future__ import annotations

import torch

from ddtree_serve.kernels.attention import AttentionMeta
from ddtree_serve.kernels.attention_invariant import invariant_paged_totals
from ddtree_serve.kernels.batch_invariant import normalize_totals, row_block_matmul
from ddtree_serve.kernels.kv_quant import read_latent


def absorb_queries(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, Hr, nope] @ W_UK [Hr, nope, kv_lora] -> q_lat [T, Hr, kv_lora], each head's GEMM over
    whole row blocks (a row's result does not depend on T)."""
    return row_block_matmul(q_nope.transpose(0, 1).contiguous(), w_uk).transpose(0, 1)  # [T, Hr, kv_lora]


def expand_values(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [T, Hr, kv_lora] x W_UV [Hr, v, kv_lora] -> o [T, Hr, v] (o[h] = o_lat[h] W_UV[h]^T), each head's
    GEMM over whole row blocks."""
    return row_block_matmul(o_lat.transpose(0, 1).contiguous(), w_uv.transpose(1, 2)).transpose(0, 1)


def _latent_source(k_cache: torch.Tensor, k_scale: torch.Tensor | None, kv_indices: torch.Tensor, kv_lora: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache the attention reads and its column indices: ``k_cache`` [slots, 1, W] itself with
    ``kv_indices`` [bs, K], or (fp8) the requests' rows dequantized into ``dtype`` [bs*K, 1, W] with
    indices ``arange`` [bs, K]."""
    if k_scale is None:
        return k_cache, kv_indices
    bs, kmax = kv_indices.shape
    lat = read_latent(k_cache, k_scale, kv_indices.reshape(-1), kv_lora, dtype)  # [bs*K, 1, W]
    return lat, torch.arange(bs * kmax, device=kv_indices.device).view(bs, kmax)


def invariant_latent_totals(
    q: torch.Tensor,  # [T, H, kv_lora + rope] absorbed queries (q_lat ; rotated q_pe)
    k_cache: torch.Tensor,  # [slots, 1, kv_lora + rope] latent cache (model dtype, or fp8 with k_scale)
    k_scale: torch.Tensor | None,  # [slots, 2] fp8 scales, else None
    meta: AttentionMeta,
    kv_lora: int,
    scale: float,
    key_ok: torch.Tensor | None = None,  # [bs, K] bool: the keys held here (DCP); None: all
    kv_indices: torch.Tensor | None = None,  # [bs, K] slots to read instead of meta.kv_indices (DCP: local)
) -> tuple[torch.Tensor, torch.Tensor]:  # total [T, H, kv_lora + 1], max [T, H] float32
    """Row-invariant latent attention before normalisation: per query and head, sum_j exp(s_j - m) [c_j, 1]
    over its visible keys in ``key_ok`` and m, their max score (ddtree_serve/kernels/attention_invariant.py)."""
    idx = meta.kv_indices if kv_indices is None else kv_indices
    cache, cols = _latent_source(k_cache, k_scale, idx, kv_lora, q.dtype)
    return invariant_paged_totals(q, cache, cache[..., :kv_lora], cols, meta.attn_mask, meta.q_index, scale,
                                  meta.prefix_lens.tolist(), meta.extend_lens.tolist(), meta.causal, key_ok)


def invariant_latent_attention(q: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                               meta: AttentionMeta, kv_lora: int, scale: float) -> torch.Tensor:
    """q [T, H, kv_lora + rope] -> o_lat [T, H, kv_lora] in q's dtype: ``masked_paged_attention`` over the
    latent cache (V = the first ``kv_lora`` columns), row-invariant. Reads the lengths on the host once."""
    total, _ = invariant_latent_totals(q, k_cache, k_scale, meta, kv_lora, scale)  # [T, H, kv_lora + 1]
    return normalize_totals(total).to(q.dtype)
