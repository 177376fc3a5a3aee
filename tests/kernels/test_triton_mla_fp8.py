"""The Triton MLA kernels (decode, extend, tree verify, split-K) over an fp8 latent cache
(``--kv-cache-dtype fp8_e4m3``, ddtree_serve/kernels/kv_quant.py) under ``TRITON_INTERPRET=1``, against the torch reference
over the same cache dequantized: both read identical float32 values, so the tolerance is the float32 one of
tests/kernels/test_triton_mla.py (atol/rtol 1e-5). The rope part is 100x smaller than the latent, so a kernel
applying one scale to both (or none) fails. Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import masked_paged_attention
from ddtree_serve.kernels.kv_quant import FP8_KV_DTYPE, dequantize_latent, quantize_latent
from ddtree_serve.model_executor.forward_batch import ForwardMode
from tests.kernels.test_triton_mla import _case

pytest.importorskip("triton")

from ddtree_serve.kernels.triton_mla import MLA_KERNELS  # noqa: E402
from ddtree_serve.kernels.triton_mla_plan import choose_mla_tiles  # noqa: E402

LAT, ROPE = 32, 8


def _fp8_case(mode, prefix, extend, heads, seed):
    fb, cache, q = _case(mode, prefix, extend, heads, LAT, ROPE, torch.float32, seed=seed)
    cache[..., LAT:] *= 0.01  # the rope part on another scale than the latent
    cache8, scales = quantize_latent(cache, LAT)  # [slots, 1, W] fp8, [slots, 2]
    deq = dequantize_latent(cache8, scales, LAT, torch.float32)  # what every reader sees
    ref = masked_paged_attention(q, deq, deq[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, 0.3)
    args = (q, cache8, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, LAT, 0.3)
    return fb, args, scales, ref


@pytest.mark.parametrize(
    "mode,prefix,extend,heads,splits",
    [
        (ForwardMode.DECODE, [5, 0, 40], [1, 1, 1], 4, 1),
        (ForwardMode.EXTEND, [0, 9], [7, 12], 4, 1),
        (ForwardMode.TARGET_VERIFY, [12, 3], [9, 5], 20, 1),
        (ForwardMode.DECODE, [33, 9], [1, 1], 4, 3),
        (ForwardMode.TARGET_VERIFY, [30], [6], 4, 2),
    ],
)
def test_fp8_cache_matches_reference_over_dequantized_cache(mode, prefix, extend, heads, splits):
    fb, args, scales, ref = _fp8_case(mode, prefix, extend, heads, seed=3 + splits + heads)
    assert args[1].dtype == FP8_KV_DTYPE
    tiles = choose_mla_tiles(heads, LAT, ROPE, torch.float32, 8_000 if splits > 1 else None,
                             cache_dtype=FP8_KV_DTYPE)
    got = MLA_KERNELS[mode.value](*args, tree_mask=fb.tree_mask, num_splits=splits, tiles=tiles, k_scale=scales)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if mode == ForwardMode.DECODE and splits == 1:  # reading the rope with the latent's scale is wrong
        swapped = scales.flip(1).contiguous()
        bad = MLA_KERNELS[mode.value](*args, k_scale=swapped)
        assert (bad - ref).abs().max() > 1e-3


def test_fp8_cache_bad_inputs():
    fb, args, scales, _ = _fp8_case(ForwardMode.DECODE, [4], [1], 4, seed=1)
    with pytest.raises(ValueError, match="needs its k_scale"):
        MLA_KERNELS["decode"](*args)
    plain = (args[0], dequantize_latent(args[1], scales, LAT, torch.float32)) + args[2:]
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        MLA_KERNELS["decode"](*plain, k_scale=scales)
