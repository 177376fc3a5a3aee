"""The DCP Triton MLA kernel (ddtree_serve/kernels/triton_mla_dcp.py) on CUDA at Kimi K2.6's shapes under TP 8 with DCP 8
(8 local heads x 8 ranks = 64 gathered heads, latent 512 + rope 64): each of the 8 rank shards of a bfloat16
and of an fp8 cache, merged by log-sum-exp, against the torch reference over the unsharded cache, for decode,
extend after a prefix and tree verify (slots placed by ``KVSlots`` with 8 shards). Tolerance: bfloat16 2e-2."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import masked_paged_attention, merge_attention_partials
from ddtree_serve.kernels.kv_quant import dequantize_latent, quantize_latent
from ddtree_serve.model_executor.kv_slots import KVSlots
from tests.model_executor.test_dcp_attention import _forwards

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAT, ROPE, HEADS, N = 512, 64, 64, 8


@pytest.mark.parametrize("fp8", [False, True])
def test_dcp8_kernel_merges_to_full_attention_at_kimi_shapes(fp8: bool, backend_report) -> None:
    pytest.importorskip("triton")
    from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS

    g = torch.Generator().manual_seed(8)
    slots = KVSlots(400, 4, 48, shards=N)
    full = torch.randn(slots.id_space, 1, LAT + ROPE, generator=g).cuda()  # [ids, 1, W] by global id
    if fp8:
        q8, sc = quantize_latent(full, LAT)
        ref_cache = dequantize_latent(q8, sc, LAT, torch.bfloat16)
    else:
        ref_cache = full.bfloat16()
    for fb in _forwards(slots):
        fb = type(fb)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(fb).items()})
        q = torch.randn(fb.q_index.numel(), HEADS, LAT + ROPE, generator=g).cuda().bfloat16()
        outs, lses = [], []
        for r in range(N):
            cache, scales = (q8[r::N].contiguous(), sc[r::N].contiguous()) if fp8 else (ref_cache[r::N].contiguous(),
                                                                                          None)
            o, lse = MLA_DCP_KERNELS[fb.mode.value](q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens,
                                                    fb.extend_lens, LAT, 0.04, fb.tree_mask, dcp_size=N, dcp_rank=r,
                                                    k_scale=scales)
            outs.append(o)
            lses.append(lse)
        ref = masked_paged_attention(q.float(), ref_cache.float(), ref_cache[..., :LAT].float(), fb.kv_indices,
                                     fb.attn_mask, fb.q_index, 0.04)
        got = merge_attention_partials(torch.stack(outs), torch.stack(lses))
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2, msg=f"{fb.mode} fp8={fp8}")
    backend_report.append(f"MLA DCP kernel ({'fp8' if fp8 else 'bf16'} cache): triton on CUDA")
