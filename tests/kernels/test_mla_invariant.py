"""Batch-invariant MLA (ddtree_serve/kernels/mla_invariant.py): a row's absorbed projections and latent attention
are bit-identical alone and inside a batch / prefill chunk / verify tree, in bfloat16 and float32, with the
cache in the model's dtype or fp8 (per-token scales). Runs the CPU's own kernels (oneDNN / MKL)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import AttentionMeta, masked_paged_attention
from ddtree_serve.kernels.batch_invariant import KV_SPLIT
from ddtree_serve.kernels.kv_quant import dequantize_latent, quantize_latent
from ddtree_serve.kernels.mla_invariant import absorb_queries, expand_values, invariant_latent_attention
from tests.kernels.test_batch_invariant import _Seq, _tree_batch

DTYPES = [torch.bfloat16, torch.float32]
LAT, ROPE, HEADS = 32, 8, 4  # the tiny Kimi's kv_lora / rope / heads
SCALE = 0.2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 16, 32, 16), (8, 128, 512, 128)])  # (heads, nope, kv_lora, v): tiny, Kimi/TP8
def test_absorption_rows_do_not_depend_on_the_token_count(dtype, shape):
    """q_nope W_UK and o_lat W_UV^T: token 7 alone equals token 7 inside 1..40 / 67 / 300-token batches at
    offsets 0, 3 and 7."""
    h, nope, lat, v = shape
    g = torch.Generator().manual_seed(11)
    w_uk = (torch.randn(h, nope, lat, generator=g) * 0.1).to(dtype)
    w_uv = (torch.randn(h, v, lat, generator=g) * 0.1).to(dtype)
    q = torch.randn(310, h, nope, generator=g).to(dtype)
    o = torch.randn(310, h, lat, generator=g).to(dtype)
    q_one, o_one = absorb_queries(q[7:8], w_uk)[0], expand_values(o[7:8], w_uv)[0]
    torch.testing.assert_close(q_one.float(), torch.einsum("hn,hnl->hl", q[7].float(), w_uk.float()),
                               atol=5e-2, rtol=2e-2)
    checked = 0
    for m in [*range(1, 41), 67, 300]:
        for off in (0, 3, 7):
            if off <= 7 < off + m:
                assert torch.equal(absorb_queries(q[off : off + m], w_uk)[7 - off], q_one), (m, off)
                assert torch.equal(expand_values(o[off : off + m], w_uv)[7 - off], o_one), (m, off)
                checked += 1
    assert checked > 80


def _meta(kv, mask, qi, reqs, causal) -> AttentionMeta:
    return AttentionMeta(causal, False, kv, mask, qi, torch.tensor([p for p, _ in reqs]),
                         torch.tensor([e for _, e in reqs]))


class _Latent:
    """A latent sequence (``_Seq`` with one KV head of width kv_lora + rope): the cache in ``dtype`` or fp8."""

    def __init__(self, dtype: torch.dtype, fp8: bool):
        self.s = _Seq(dtype, hq=HEADS, hkv=1, d=LAT + ROPE)
        self.cache, self.scales = self.s.k, None
        if fp8:
            self.cache, self.scales = quantize_latent(self.s.k, LAT)

    def dense(self) -> torch.Tensor:
        """The cache as the reference reads it."""
        if self.scales is None:
            return self.cache
        return dequantize_latent(self.cache, self.scales, LAT, self.s.q.dtype)

    def attend(self, reqs: list[tuple[int, int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        q, kv, mask, qi = self.s.causal(reqs, pad)
        out = invariant_latent_attention(q, self.cache, self.scales, _meta(kv, mask, qi, reqs, True), LAT, SCALE)
        ref = masked_paged_attention(q, self.dense(), self.dense()[..., :LAT], kv, mask, qi, SCALE)
        return out, ref


@pytest.mark.parametrize(("dtype", "fp8"), [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_latent_attention_row_alone_equals_chunk_batch_and_tree(dtype, fp8):
    """A position's latent attention is the same from one 200-token prefill, chunked prefills split at and off
    ``KV_SPLIT`` boundaries, a decode row, a batch beside other requests with padded key widths, and as an
    on-path node of a verify tree (ancestors at scattered columns behind masked siblings); and it is the
    reference attention up to rounding."""
    lat = _Latent(dtype, fp8)
    full, ref = lat.attend([(0, 200)])
    torch.testing.assert_close(full.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    for pre in (0, 1, KV_SPLIT - 1, KV_SPLIT, 150, 199):
        for n in (1, 9, 200 - pre):
            if pre + n <= 200:
                assert torch.equal(lat.attend([(pre, n)], pad=13)[0], full[pre : pre + n]), (pre, n)
    batch = lat.attend([(5, 3), (120, 1), (0, 70)], pad=7)[0]
    assert torch.equal(batch[:3], full[5:8]) and torch.equal(batch[3], full[120]) and torch.equal(batch[4:], full[:70])
    parents = [-1, -1, 0, 1, 2, 2, 4, -1, 6, 3]
    on_path = [True, False, True, False, False, True, False, False, False, False]
    for prefix in (3, KV_SPLIT - 2, 130):
        q, kv, mask, depth = _tree_batch(lat.s, prefix, parents, on_path)
        reqs = [(prefix, len(parents))]
        out = invariant_latent_attention(q, lat.cache, lat.scales, _meta(kv, mask, torch.arange(len(parents)), reqs,
                                                                          False), LAT, SCALE)
        for i in (0, 2, 5):
            assert torch.equal(out[i], full[prefix + int(depth[i])]), (prefix, i)
