"""The query-tiled EXTEND kernel (ddtree_serve/kernels/triton_mla_extend.py) under ``TRITON_INTERPRET=1`` against the
reference ``masked_paged_attention``: several requests of different lengths, prompts that are not a
multiple of ``BLOCK_M``, prefixes 0 and not, rows that are not a multiple of the heads (3 heads in 16 rows:
5 tokens a block), more heads than rows (20 heads in 16 rows: two head groups, one token a block), the
default 64 rows; bfloat16 and an fp8 cache. Plus the host's block map (``extend_blocks``): every token in
exactly one block, at most the grid it bounds. Tolerances: float32 1e-5, bfloat16 2e-2."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import masked_paged_attention
from ddtree_serve.kernels.kv_quant import dequantize_latent, quantize_latent
from ddtree_serve.model_executor.forward_batch import ForwardMode
from tests.kernels.test_triton_mla import _case

pytest.importorskip("triton")

from ddtree_serve.kernels.triton_mla import MLA_KERNELS  # noqa: E402
from ddtree_serve.kernels.triton_mla_extend import extend_blocks  # noqa: E402
from ddtree_serve.kernels.triton_mla_plan import MlaTiles, choose_mla_tiles  # noqa: E402

LAT, ROPE = 32, 8


def _tiles(rows: int) -> MlaTiles:
    return MlaTiles(rows, 16, LAT, 16, 0)


@pytest.mark.parametrize("heads,rows", [(3, 16), (20, 16), (4, None)])
@pytest.mark.parametrize("prefix,extend", [([0, 9, 33], [7, 1, 20]), ([4, 0], [13, 11])])
def test_query_tiled_extend_matches_reference(heads: int, rows: int | None, prefix: list[int],
                                              extend: list[int]) -> None:
    fb, cache, q = _case(ForwardMode.EXTEND, prefix, extend, heads, LAT, ROPE, torch.float32, seed=heads + len(prefix))
    ref = masked_paged_attention(q, cache, cache[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, 0.3)
    got = MLA_KERNELS["extend"](q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens,
                                LAT, 0.3, num_splits=1, tiles=None if rows is None else _tiles(rows))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_query_tiled_extend_bf16_and_fp8() -> None:
    prefix, extend = [5, 17], [9, 6]
    fb, cache, q = _case(ForwardMode.EXTEND, prefix, extend, 4, LAT, ROPE, torch.bfloat16, seed=2)
    args = (fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, LAT, 0.3)
    ref = masked_paged_attention(q.float(), cache.float(), cache[..., :LAT].float(), *args[:3], 0.3)
    got = MLA_KERNELS["extend"](q, cache, *args, num_splits=1, tiles=_tiles(16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    cache8, scales = quantize_latent(cache.float(), LAT)  # [slots, 1, W] fp8, [slots, 2]
    deq = dequantize_latent(cache8, scales, LAT, torch.float32)
    qf = q.float()
    ref8 = masked_paged_attention(qf, deq, deq[..., :LAT], *args[:3], 0.3)
    tiles = choose_mla_tiles(16, LAT, ROPE, torch.float32, None, cache_dtype=cache8.dtype)
    got8 = MLA_KERNELS["extend"](qf, cache8, *args, num_splits=1, tiles=tiles, k_scale=scales)
    torch.testing.assert_close(got8, ref8, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [1, 3, 8])
def test_extend_blocks_cover_every_token_once(block_m: int) -> None:
    ext = torch.tensor([7, 1, 0, 20, 8])
    t = int(ext.sum())
    req, i0, tok_start = extend_blocks(ext, block_m, t)
    assert req.shape[0] <= t and req.shape[0] >= int(((ext + block_m - 1) // block_m).sum())
    rows = []
    for b, i in zip(req.tolist(), i0.tolist(), strict=True):
        n = max(0, min(int(ext[b]) - i, block_m))
        rows += [int(tok_start[b]) + i + m for m in range(n)]
    assert sorted(rows) == list(range(t))
