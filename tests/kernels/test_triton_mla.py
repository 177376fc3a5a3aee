"""Triton MLA kernels (ddtree_serve/kernels/triton_mla.py) under ``TRITON_INTERPRET=1`` against the reference
``masked_paged_attention`` over the same latent cache and ``ForwardBatch`` metadata.

Shapes: ragged batches (prefix 0 included), random token slots, random draft trees, latent 32 / rope 8
(rope padded to a 16-wide tile), latent 48 (not a power of two), 4 and 20 heads (two head blocks).
Tolerances: float32 atol/rtol 1e-5 (online vs one-shot softmax); bfloat16 cache 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import masked_paged_attention
from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch

pytest.importorskip("triton")

from ddtree_serve.kernels.triton_mla import MLA_KERNELS  # noqa: E402
from ddtree_serve.kernels.triton_mla_plan import choose_mla_tiles  # noqa: E402


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
    total = [p + e for p, e in zip(prefix, extend, strict=True)]
    bs, slots = len(prefix), max(200, sum(total) + 20)
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


SPLIT_CASES = [  # (mode, prefix, extend, heads, dtype, splits): empty splits, one-key requests, two head blocks
    (ForwardMode.DECODE, [5, 0, 40, 70], [1, 1, 1, 1], 4, torch.float32, 3),
    (ForwardMode.TARGET_VERIFY, [12, 3, 30], [9, 5, 17], 20, torch.float32, 4),
    (ForwardMode.DECODE, [33, 9], [1, 1], 4, torch.bfloat16, 2),
]


@pytest.mark.parametrize("mode,prefix,extend,heads,dtype,splits", SPLIT_CASES)
def test_split_k_matches_reference(mode, prefix, extend, heads, dtype, splits):
    """issue 33 item 8: the split-K (flash-decoding) variant with its log-sum-exp merge, on 16-key tiles
    so that every request spans several splits; in the verify case some splits hold only keys a node
    cannot see (their lse is -inf and they must add nothing)."""
    lat, rope = 32, 8
    fb, cache, q = _case(mode, prefix, extend, heads, lat, rope, dtype, seed=11 + splits)
    tiles = choose_mla_tiles(heads, lat, rope, dtype, smem_limit=8_000)
    assert tiles is not None and tiles.block_n == 16
    ref = masked_paged_attention(q, cache, cache[..., :lat], fb.kv_indices, fb.attn_mask, fb.q_index, 0.3)
    args = (q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, lat, 0.3)
    got = MLA_KERNELS[mode.value](*args, num_splits=splits, tiles=tiles)
    one = MLA_KERNELS[mode.value](*args, num_splits=1, tiles=tiles)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), one.float(), atol=tol, rtol=tol)


def test_long_context_decode_takes_the_split_path(monkeypatch):
    """The launch's choice: a decode of one request over 1,100 keys on a GPU of 132 SMs (the SM count, a
    device fact, is given: there is none on CPU) runs split-K (2 splits of >= 512 keys) and matches the
    reference; the same call on CPU (no SM count) runs the single-pass kernel."""
    import ddtree_serve.kernels.triton_mla as tm

    calls = []
    real = tm.launch_split
    monkeypatch.setattr(tm, "launch_split", lambda *a, **kw: calls.append(a[-1]) or real(*a, **kw))
    fb, cache, q = _case(ForwardMode.DECODE, [1100], [1], 4, 32, 8, torch.float32, seed=3)
    args = (q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens, 32, 0.3)
    ref = masked_paged_attention(q, cache, cache[..., :32], fb.kv_indices, fb.attn_mask, fb.q_index, 0.3)
    torch.testing.assert_close(MLA_KERNELS["decode"](*args), ref, atol=1e-5, rtol=1e-5)
    assert calls == []
    monkeypatch.setattr(tm, "device_sm_count", lambda *dev: 132)
    torch.testing.assert_close(MLA_KERNELS["decode"](*args), ref, atol=1e-5, rtol=1e-5)
    assert calls == [2]
