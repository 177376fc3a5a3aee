"""Triton MLA kernels (kernels/triton_mla.py) under ``TRITON_INTERPRET=1`` against the reference
``masked_paged_attention`` over the same latent cache and ``ForwardBatch`` metadata.

Shapes: ragged batches (prefix 0 included), random token slots, random draft trees, latent 32 / rope 8
(rope padded to a 16-wide tile), latent 48 (not a power of two), 4 and 20 heads (two head blocks).
Tolerances: float32 atol/rtol 1e-5 (online vs one-shot softmax); bfloat16 cache 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import masked_paged_attention
from model_executor.forward_batch import ForwardMode, build_forward_batch

pytest.importorskip("triton")

from kernels.triton_mla import MLA_KERNELS  # noqa: E402


def _tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """Random rooted tree over n nodes (parent index < child index) -> [n, n] ancestor-or-self mask."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j], j = True, parents[j]
    return mask


def _case(
    mode: ForwardMode,
    prefix: list[int],
    extend: list[int],
    heads: int,
    lat: int,
    rope: int,
    dtype: torch.dtype,
    seed: int,
):
    g = torch.Generator().manual_seed(seed)
    bs, slots = len(prefix), 200
    total = [p + e for p, e in zip(prefix, extend, strict=True)]
    perm = torch.randperm(slots, generator=g)[: sum(total)] + 1  # distinct non-padding slots, shuffled
    table = torch.zeros(bs, max(total), dtype=torch.int64)
    off = 0
    for b, n in enumerate(total):
        table[b, :n] = perm[off : off + n]
        off += n
    new_slots = torch.cat([table[b, prefix[b] : total[b]] for b in range(bs)])
    q_max = max(extend)
    tree = None
    if mode == ForwardMode.TARGET_VERIFY:
        tree = torch.zeros(bs, q_max, q_max, dtype=torch.bool)
        for b, n in enumerate(extend):
            tree[b, :n, :n] = _tree_mask(n, g)
    t = sum(extend)
    fb = build_forward_batch(
        mode,
        torch.zeros(t, dtype=torch.int64),
        torch.zeros(t, dtype=torch.int64),
        new_slots,
        table,
        torch.arange(bs),
        torch.tensor(prefix),
        torch.tensor(extend),
        tree_mask=tree,
    )
    cache = torch.randn(slots + 1, 1, lat + rope, generator=g).to(dtype)  # [slots, 1, L + R]
    q = torch.randn(t, heads, lat + rope, generator=g).to(dtype)  # [T, Hr, L + R]
    return fb, cache, q


@pytest.mark.parametrize(
    "mode,prefix,extend",
    [
        (ForwardMode.DECODE, [5, 0, 40, 17], [1, 1, 1, 1]),
        (ForwardMode.EXTEND, [0, 9, 33], [7, 1, 20]),
        (ForwardMode.TARGET_VERIFY, [12, 3, 30], [9, 5, 17]),
    ],
)
@pytest.mark.parametrize("heads,lat,rope", [(4, 32, 8), (20, 48, 16)])
def test_mla_kernels_match_reference(mode, prefix, extend, heads, lat, rope):
    fb, cache, q = _case(mode, prefix, extend, heads, lat, rope, torch.float32, seed=len(prefix) + heads)
    scale = 0.3
    ref = masked_paged_attention(q, cache, cache[..., :lat], fb.kv_indices, fb.attn_mask, fb.q_index, scale)
    got = MLA_KERNELS[mode.value](
        q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, lat, scale
    )
    assert got.shape == ref.shape == (sum(extend), heads, lat)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if mode == ForwardMode.TARGET_VERIFY:  # the compact [bs, Q, Q] tree mask ForwardBatch carries
        assert fb.tree_mask is not None and fb.tree_mask.shape == (len(prefix), max(extend), max(extend))
        got = MLA_KERNELS[mode.value](q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens,
                                      fb.extend_lens, lat, scale, fb.tree_mask)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_mla_verify_bf16_and_mask_is_read():
    fb, cache, q = _case(ForwardMode.TARGET_VERIFY, [6, 21], [8, 4], 4, 32, 8, torch.bfloat16, seed=7)
    ref = masked_paged_attention(q, cache, cache[..., :32], fb.kv_indices, fb.attn_mask, fb.q_index, 0.25)
    args = (q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, 32, 0.25)
    got = MLA_KERNELS["target_verify"](*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    causal = MLA_KERNELS["extend"](*args)  # a tree is not a chain: ignoring the mask must change the answer
    assert (causal.float() - ref.float()).abs().max() > 0.05
