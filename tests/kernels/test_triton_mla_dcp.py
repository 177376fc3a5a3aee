"""The DCP Triton MLA kernel (ddtree_serve/kernels/triton_mla_dcp.py) under ``TRITON_INTERPRET=1``: on each rank's shard of a
KV pool placed by ``KVSlots`` with 2 and 3 DCP ranks (tree nodes by position), its partial output and
log-sum-exp equal the torch reference's (``masked_paged_attention_lse`` over ``shard_keys``) for extend after a
prefix, decode and tree verify, and the merged partials equal full attention over the unsharded cache; an fp8
cache (per-token scales) against the reference over its dequantized rows. Tolerances: float32 1e-5 (online vs
one-shot softmax)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import (
    masked_paged_attention,
    masked_paged_attention_lse,
    merge_attention_partials,
)
from ddtree_serve.kernels.kv_quant import dequantize_latent, quantize_latent
from ddtree_serve.model_executor.forward_batch import ForwardBatch
from ddtree_serve.model_executor.kv_slots import KVSlots
from ddtree_serve.model_executor.layers.dcp_attention import shard_keys
from tests.model_executor.test_dcp_attention import _forwards

pytest.importorskip("triton")

from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS  # noqa: E402

LAT, ROPE, HEADS = 16, 8, 3


def _run(fb: ForwardBatch, q: torch.Tensor, cache: torch.Tensor, n: int, r: int, scales: torch.Tensor | None):
    return MLA_DCP_KERNELS[fb.mode.value](q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens,
                                          fb.extend_lens, LAT, 0.25, fb.tree_mask, dcp_size=n, dcp_rank=r,
                                          k_scale=scales)


@pytest.mark.parametrize("n", [2, 3])
def test_dcp_kernel_partials_match_the_reference_and_merge_to_full(n: int) -> None:
    g = torch.Generator().manual_seed(10 + n)
    slots = KVSlots(60, 4, 48, shards=n)
    full = torch.randn(slots.id_space, 1, LAT + ROPE, generator=g)  # [ids, 1, W] by global id
    local = [full[r::n].contiguous() for r in range(n)]
    for fb in _forwards(slots):
        q = torch.randn(fb.q_index.numel(), HEADS, LAT + ROPE, generator=g)
        outs, lses = [], []
        for r in range(n):
            o, lse = _run(fb, q, local[r], n, r, None)
            idx, mine = shard_keys(fb.kv_indices, n, r)
            ro, rlse = masked_paged_attention_lse(q, local[r], local[r][..., :LAT], idx, fb.attn_mask & mine[:, None],
                                                  fb.q_index, 0.25)
            torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5, msg=f"{fb.mode} rank {r}")
            assert bool((torch.isinf(lse) == torch.isinf(rlse)).all())
            fin = torch.isfinite(rlse)
            torch.testing.assert_close(lse[fin], rlse[fin], atol=1e-5, rtol=1e-5)
            outs.append(o)
            lses.append(lse)
        ref = masked_paged_attention(q, full, full[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, 0.25)
        merged = merge_attention_partials(torch.stack(outs), torch.stack(lses))
        torch.testing.assert_close(merged, ref, atol=1e-5, rtol=1e-5, msg=f"{fb.mode}")


def test_dcp_kernel_reads_an_fp8_shard() -> None:
    g = torch.Generator().manual_seed(3)
    n = 2
    slots = KVSlots(60, 4, 48, shards=n)
    q8, sc = quantize_latent(torch.randn(slots.id_space, 1, LAT + ROPE, generator=g), LAT)  # fp8 rows, [ids, 2]
    deq = dequantize_latent(q8, sc, LAT, torch.float32)  # [ids, 1, W] what the kernel must read
    for fb in _forwards(slots):
        q = torch.randn(fb.q_index.numel(), HEADS, LAT + ROPE, generator=g)
        outs, lses = [], []
        for r in range(n):
            o, lse = _run(fb, q, q8[r::n].contiguous(), n, r, sc[r::n].contiguous())
            outs.append(o)
            lses.append(lse)
        ref = masked_paged_attention(q, deq, deq[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, 0.25)
        torch.testing.assert_close(merge_attention_partials(torch.stack(outs), torch.stack(lses)), ref,
                                   atol=1e-5, rtol=1e-5, msg=f"{fb.mode}")
