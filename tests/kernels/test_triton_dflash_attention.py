"""The DFlash drafter's block attention (ddtree_serve/kernels/dflash_attention.py, its Triton kernel
ddtree_serve/kernels/triton_dflash_attention.py; docs/DESIGN.md 4.17): the torch reference equals the eager drafter
path's attention (``windowed_batch`` + the torch backend, block K/V written to temporary slots) for every layer
kind, and the Triton kernel under ``TRITON_INTERPRET=1`` equals the reference: full and sliding layers (a window
smaller than, equal to and larger than the context), causal and not, the draft-window cap, contexts of 0, 1 and
many keys (several key tiles), grouped heads, float32 and bfloat16, a head size that is not a power of two, the
context cut into key splits.
Tolerances: float32 1e-5 (online vs one-shot softmax), bfloat16 2e-2 (as tests/kernels/test_triton_mla.py)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.kernels.dflash_attention import context_bound, dflash_block_attention_reference
from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.models.dflash_window import DraftAttention, windowed_batch

CONTEXTS = (0, 1, 37, 9)  # no key, one key, several 16-key tiles, a few
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
KINDS = [  # (window, causal, cap)
    (None, False, None), (None, True, None), (None, False, 5),
    (4, True, None), (4, False, None),  # a window smaller than most contexts
    (9, False, None), (9, True, 3),  # a window equal to one context (9), with a cap tighter than it
    (64, False, None), (64, True, 20),  # a window larger than every context, a cap
]


def _case(heads: tuple[int, int], d: int, blk: int, dtype: torch.dtype, seed: int = 0):
    """Random paged context for ``CONTEXTS`` -> (q, kb, vb, k_cache, v_cache, table, idx, cached)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    bs, slots = len(CONTEXTS), 300
    table = torch.zeros(bs + 2, 64, dtype=torch.int64)
    perm = torch.randperm(slots - 101, generator=g) + 1  # distinct non-padding slots (the last 100: _eager's)
    idx = torch.tensor([3, 0, 5, 1])  # request rows out of order
    off = 0
    for b, n in enumerate(CONTEXTS):
        table[idx[b], :n] = perm[off:off + n]
        off += n
    k_cache = (torch.randn(slots, hkv, d, generator=g)).to(dtype)  # [S, Hkv, d]
    v_cache = (torch.randn(slots, hkv, d, generator=g)).to(dtype)
    t = bs * blk
    q = (torch.randn(t, hq, d, generator=g) * 2).to(dtype)  # [bs*B, Hq, d]
    kb = torch.randn(t, hkv, d, generator=g).to(dtype)
    vb = torch.randn(t, hkv, d, generator=g).to(dtype)
    return q, kb, vb, k_cache, v_cache, table, idx, torch.tensor(CONTEXTS)


def _eager(q, kb, vb, k_cache, v_cache, table, idx, cached, window, causal, cap, scale):  # noqa: ANN001
    """The drafter's eager path: block K/V into free slots of a copy of the cache, ``windowed_batch``'s key list
    and mask, the torch backend."""
    bs, blk = idx.shape[0], q.shape[0] // idx.shape[0]
    table, kc, vc = table.clone(), k_cache.clone(), v_cache.clone()
    free = torch.arange(kc.shape[0] - bs * blk, kc.shape[0])  # [bs*B] (the context slots stay below 200)
    for b in range(bs):
        table[idx[b], cached[b]:cached[b] + blk] = free[b * blk:(b + 1) * blk]
    pos = (cached[:, None] + torch.arange(blk)).view(-1)
    fb = build_forward_batch(ForwardMode.TARGET_VERIFY, torch.zeros(bs * blk, dtype=torch.int64), pos, free, table,
                             idx, cached, torch.full((bs,), blk), tree_mask=torch.ones(bs, blk, blk, dtype=torch.bool))
    lfb = windowed_batch(fb, DraftAttention(window, causal), cap)
    return TorchAttentionBackend().forward(q.float(), kb.float(), vb.float(), kc, vc, lfb.out_cache_loc,
                                           lfb.kv_indices, lfb.attn_mask, lfb.q_index, scale)


def test_context_bound():
    assert context_bound(64, None, None) == 64 and context_bound(64, 9, None) == 8
    assert context_bound(64, 9, 3) == 3 and context_bound(2, 9, None) == 2 and context_bound(64, 1, None) == 0


@pytest.mark.parametrize(("window", "causal", "cap"), KINDS)
def test_reference_equals_the_eager_drafter_attention(window, causal, cap):
    case = _case((4, 2), 16, 5, torch.float32)
    want = _eager(*case, window, causal, cap, 0.25)
    got = dflash_block_attention_reference(*case, window, causal, cap, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tight = dflash_block_attention_reference(*case, window, causal, cap, 0.25, max_context=40)  # >= every context
    torch.testing.assert_close(tight, got, atol=1e-6, rtol=1e-6)


def test_reference_reads_no_later_context():
    """Slots past a request's context (stale K/V of an earlier request) do not change its output."""
    q, kb, vb, kc, vc, table, idx, cached = _case((2, 2), 16, 4, torch.float32)
    got = dflash_block_attention_reference(q, kb, vb, kc, vc, table, idx, cached, None, False, None, 0.3)
    table[idx[2], cached[2]:] = 7  # a real slot's values, beyond the context
    assert torch.equal(dflash_block_attention_reference(q, kb, vb, kc, vc, table, idx, cached, None, False, None,
                                                        0.3), got)


pytest.importorskip("triton")

from ddtree_serve.kernels.triton_dflash_attention import triton_dflash_block_attention  # noqa: E402


@pytest.mark.parametrize(("window", "causal", "cap"), KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_reference(window, causal, cap, dtype):
    case = _case((4, 2), 16, 5, dtype, seed=1)  # grouped heads (2 query heads per KV head), a 5-token block
    want = dflash_block_attention_reference(*case, window, causal, cap, 0.25)
    got = triton_dflash_block_attention(*case, window, causal, cap, 0.25, block_n=16)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(("heads", "d", "blk"), [((2, 2), 12, 4), ((8, 1), 16, 16), ((3, 1), 8, 3)])
def test_triton_shapes(heads, d, blk):
    """Plain MHA with a head size that is not a power of two; 8 query heads on one KV head over a 16-token block
    (128 rows: two row tiles, each with its own window start); 3 heads on one KV head, a 3-token block."""
    case = _case(heads, d, blk, torch.float32, seed=2)
    for window, causal, cap in ((None, False, None), (4, True, 6)):
        want = dflash_block_attention_reference(*case, window, causal, cap, d**-0.5)
        got = triton_dflash_block_attention(*case, window, causal, cap, d**-0.5, block_n=16)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize(("window", "causal", "cap"), [(None, False, None), (9, True, None), (64, False, 20),
                                                      (4, False, 2)])
def test_triton_key_splits_equal_reference(splits, window, causal, cap):
    """Context keys cut into 2, 3 or 5 chunks of 16-key tiles (some empty: contexts 0, 1 and 9), merged."""
    case = _case((4, 2), 16, 5, torch.float32, seed=3)
    want = dflash_block_attention_reference(*case, window, causal, cap, 0.25)
    got = triton_dflash_block_attention(*case, window, causal, cap, 0.25, block_n=16, num_splits=splits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_triton_refuses_ungrouped_heads():
    q, kb, vb, kc, vc, table, idx, cached = _case((4, 2), 16, 2, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        triton_dflash_block_attention(q[:, :3], kb, vb, kc, vc, table, idx, cached, None, False, None, 1.0)
