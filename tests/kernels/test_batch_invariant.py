"""Batch-invariant primitives (ddtree_serve/kernels/batch_invariant.py, attention_invariant.py): a row computed
alone and inside a batch / tree / chunk gives bit-identical outputs, in bfloat16 and float32.

These run on the CPU's own kernels (torch's oneDNN / MKL), so they check the claims made for this machine:
row-blocked GEMMs are M-invariant, RMSNorm / rotary / SwiGLU are row-wise, and the position-split attention
gives a query the same output whatever runs beside it and wherever its keys sit in the cache.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import masked_paged_attention
from ddtree_serve.kernels.attention_invariant import InvariantAttentionBackend, invariant_paged_attention
from ddtree_serve.kernels.batch_invariant import (
    KV_SPLIT,
    invariant_linear,
    row_block_matmul,
    split_numerators,
)
from ddtree_serve.model_executor.layers.activation import silu_and_mul
from ddtree_serve.model_executor.layers.embedding import ParallelLMHead
from ddtree_serve.model_executor.layers.linear import use_invariant_linears
from ddtree_serve.model_executor.layers.norm import RMSNorm
from ddtree_serve.model_executor.layers.rotary import RotaryEmbedding
from ddtree_serve.model_executor.parallel_state import TPGroup

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_n", [(64, 64), (576, 1536), (1536, 576)])
def test_linear_row_alone_equals_row_in_batches(dtype, k_n):
    """Row 7 alone vs inside batches of 1..67 rows at offsets 0, 3, 7 (and a 300-row chunk): bit-identical
    (unpadded, bfloat16 GEMM on this CPU differs between M=1 and M=2 at K=1536, N=576)."""
    k, n = k_n
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(320, k, generator=g).to(dtype)
    alone = invariant_linear(x[7:8], w)[0]
    checked = 0
    for m in [*range(1, 68), 300]:
        for off in (0, 3, 7):
            if off <= 7 < off + m <= x.shape[0]:
                assert torch.equal(invariant_linear(x[off : off + m], w)[7 - off], alone), (m, off)
                checked += 1
    assert checked > 150


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_rows_are_m_invariant(dtype):
    """The LM head switched by ``use_invariant_linears`` (docs/DESIGN.md 4.18), at the default model's head shape
    (576 -> 49152): a row's float32 logits alone equal the row's inside 1..67-row batches and a 300-row chunk,
    gathered (``compute_logits``) and vocabulary-parallel (``local_logits``)."""
    g = torch.Generator().manual_seed(5)
    head = ParallelLMHead(49152, 576, TPGroup(), dtype)
    head.weight.data.copy_((torch.randn(49152, 576, generator=g) * 0.05).to(dtype))
    assert use_invariant_linears(head) == 1 and head.row_invariant
    x = torch.randn(310, 576, generator=g).to(dtype)
    alone = head.compute_logits(x[7:8])[0]
    assert torch.equal(head.local_logits(x[7:8])[0], alone)
    for m in [*range(1, 68, 3), 300]:
        off = 7 - (m - 1) // 2 if m < 15 else 0
        assert torch.equal(head.compute_logits(x[off : off + m])[7 - off], alone), m


def test_row_block_matmul_broadcasts_and_matches_matmul():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 13, 16, generator=g), torch.randn(2, 3, 16, 5, generator=g)
    out = row_block_matmul(a, b)
    assert out.shape == (2, 3, 13, 5)
    torch.testing.assert_close(out, a @ b)


@pytest.mark.parametrize("dv", [4, 8, 10, 32, 64])
def test_numerators_do_not_depend_on_the_row_position(dv):
    """A query row's P.[V, 1] partial is the same at every position of the matrix: rows are (head, query) pairs,
    so a row's position moves with the number of queries. Small value widths are padded to ``MIN_VALUE_COLS``
    columns (unpadded, dv = 8 and 10 give a row different bits by its position mod 4 here)."""
    g = torch.Generator().manual_seed(6)
    s = torch.randn(1, 1, 2, 120, KV_SPLIT, generator=g)  # [B, H, S, M, C]
    s[..., 40:] = float("-inf")
    v = torch.randn(1, 1, 2, KV_SPLIT, dv, generator=g)
    m = s.amax(dim=(2, 4))  # [B, H, M]
    alone = split_numerators(s[:, :, :, 5:6], m[:, :, 5:6], v)[:, :, :, 0]
    for pos in range(16):
        rows = torch.roll(torch.arange(120), pos - 5)  # row 5 moved to ``pos``
        assert torch.equal(split_numerators(s[:, :, :, rows], m[:, :, rows], v)[:, :, :, pos], alone), pos


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rotary_swiglu_are_row_wise(dtype):
    g = torch.Generator().manual_seed(2)
    h = 576
    norm = RMSNorm(h, 1e-5, dtype)
    norm.weight.data = torch.randn(h, generator=g).to(dtype)
    rot = RotaryEmbedding(64, {"rope_theta": 10000.0}, 4096)
    x = (torch.randn(300, h, generator=g) * 3).to(dtype)
    qk = torch.randn(300, 9, 64, generator=g).to(dtype)
    gu = torch.randn(300, 2 * h, generator=g).to(dtype)
    pos = torch.arange(300) + 17
    one_n, one_s = norm(x[5:6])[0], silu_and_mul(gu[5:6])[0]
    one_r = rot.apply(qk[5:6], *rot.cos_sin(pos[5:6]))[0]
    for m in (1, 2, 7, 16, 33, 64, 200):
        assert torch.equal(norm(x[: m + 5])[5], one_n), m
        assert torch.equal(silu_and_mul(gu[: m + 5])[5], one_s), m
        assert torch.equal(rot.apply(qk[: m + 5], *rot.cos_sin(pos[: m + 5]))[5], one_r), m


class _Seq:
    """One token sequence in a paged cache: the token at position p has its k/v in slot p + 1 (slot 0 is the
    padding slot), and a fixed query vector per position; off-sequence tokens (tree siblings) use other slots."""

    def __init__(self, dtype: torch.dtype, n: int = 400, hq: int = 9, hkv: int = 3, d: int = 64):
        g = torch.Generator().manual_seed(3)
        self.k = torch.randn(2 * n, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(2 * n, hkv, d, generator=g).to(dtype)
        self.q = torch.randn(n, hq, d, generator=g).to(dtype)
        self.n = n

    def causal(self, reqs: list[tuple[int, int]], pad: int = 0) -> tuple[torch.Tensor, ...]:
        """A batch of (prefix, extend) causal requests on the same sequence -> (q, kv_indices, mask, q_index)."""
        width = max(p + e for p, e in reqs) + pad
        qmax = max(e for _, e in reqs)
        kv = torch.zeros(len(reqs), width, dtype=torch.long)
        mask = torch.zeros(len(reqs), qmax, width, dtype=torch.bool)
        mask[:, :, 0] = True  # padded query rows see key 0 only
        qs, qi = [], []
        for b, (p, e) in enumerate(reqs):
            kv[b, : p + e] = torch.arange(1, p + e + 1)
            for i in range(e):
                mask[b, i] = False
                mask[b, i, : p + i + 1] = True
                qi.append(b * qmax + i)
            qs.append(self.q[p : p + e])
        return torch.cat(qs), kv, mask, torch.tensor(qi)

    def attend(self, reqs, pad=0, dtype_ref=False):
        q, kv, mask, qi = self.causal(reqs, pad)
        out = invariant_paged_attention(q, self.k, self.v, kv, mask, qi, 0.125, [p for p, _ in reqs],
                                        [e for _, e in reqs], True)
        return (out, masked_paged_attention(q, self.k, self.v, kv, mask, qi, 0.125)) if dtype_ref else out


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_equals_prefill_chunk_and_batch(dtype):
    """A position's attention is the same from one 200-token prefill, any chunked prefill split (at and off
    ``KV_SPLIT`` boundaries), a decode row, and inside batches with other requests and padded key widths; and
    it is the reference attention up to rounding."""
    s = _Seq(dtype)
    full, ref = s.attend([(0, 200)], dtype_ref=True)
    torch.testing.assert_close(full.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    for pre in (0, 1, KV_SPLIT - 1, KV_SPLIT, KV_SPLIT + 1, 150, 199):
        for n in (1, 2, 9, 200 - pre):
            if pre + n <= 200:
                assert torch.equal(s.attend([(pre, n)], pad=13), full[pre : pre + n]), (pre, n)
    batch = s.attend([(5, 3), (120, 1), (0, 70), (199, 1)], pad=7)
    assert torch.equal(batch[:3], full[5:8])
    assert torch.equal(batch[3], full[120])
    assert torch.equal(batch[4:74], full[:70])
    assert torch.equal(batch[74], full[199])


def _tree_batch(s: _Seq, prefix: int, parents: list[int], on_path: list[bool]):
    """One tree-verify request: node i's parent (-1 = root child); on-path nodes are the sequence's next tokens
    at their depth, the others siblings with their own slots and queries."""
    n = len(parents)
    tm = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            tm[i, j] = True
            j = parents[j]
    depth = tm.sum(1) - 1
    slots = [prefix + 1 + int(depth[i]) if on_path[i] else s.n + 1 + i for i in range(n)]
    kv = torch.zeros(1, prefix + n, dtype=torch.long)
    kv[0, :prefix] = torch.arange(1, prefix + 1)
    kv[0, prefix:] = torch.tensor(slots)
    mask = torch.zeros(1, n, prefix + n, dtype=torch.bool)
    mask[0, :, :prefix] = True
    mask[0, :, prefix:] = tm
    g = torch.Generator().manual_seed(4)
    q = torch.stack([s.q[prefix + int(depth[i])] if on_path[i] else torch.randn(s.q.shape[1:], generator=g).to(s.q.dtype)
                     for i in range(n)])
    return q, kv, mask, depth


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [3, KV_SPLIT - 2, KV_SPLIT, 130])
def test_attention_tree_node_equals_decode_row(dtype, prefix):
    """A tree node on the sequence's path, whose ancestors sit at scattered columns behind masked siblings,
    gets the same attention as that position's decode / prefill row; also as a request inside a batch."""
    s = _Seq(dtype)
    full = s.attend([(0, 200)])
    parents = [-1, -1, 0, 1, 2, 2, 4, -1, 6, 3]
    on_path = [True, False, True, False, False, True, False, False, False, False]
    on_path[6] = False
    # path: node 0 (depth 0) -> node 2 (depth 1) -> node 5 (depth 2); node 8 under 6 under 4 under 2: off path
    q, kv, mask, depth = _tree_batch(s, prefix, parents, on_path)
    out = invariant_paged_attention(q, s.k, s.v, kv, mask, torch.arange(len(parents)), 0.125, [prefix], [len(parents)], False)
    for i in (0, 2, 5):
        assert torch.equal(out[i], full[prefix + int(depth[i])]), i
    ref = masked_paged_attention(q, s.k, s.v, kv, mask, torch.arange(len(parents)), 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    # the same tree next to another request (a wider padded key width, more queries)
    q2, kv2, mask2, _ = s.causal([(20, 30)], pad=0)
    n = len(parents)
    width = max(kv.shape[1], kv2.shape[1]) + 5
    kvb = torch.zeros(2, width, dtype=torch.long)
    kvb[0, : kv.shape[1]], kvb[1, : kv2.shape[1]] = kv[0], kv2[0]
    mb = torch.zeros(2, 30, width, dtype=torch.bool)
    mb[:, :, 0] = True
    mb[0, :n] = False
    mb[0, :n, : kv.shape[1]] = mask[0]
    mb[1, :, : kv2.shape[1]] = mask2[0]
    both = invariant_paged_attention(torch.cat([q, q2]), s.k, s.v, kvb, mb, torch.cat([torch.arange(n), 30 + torch.arange(30)]), 0.125, [prefix, 20], [n, 30], False)
    assert torch.equal(both[:n], out)


def test_attention_rejects_a_mask_that_is_not_a_tree():
    s = _Seq(torch.float32)
    kv = torch.arange(1, 13)[None]
    mask = torch.ones(1, 2, 12, dtype=torch.bool)  # two new keys both visible to both nodes: same depth twice
    with pytest.raises(ValueError, match="not a tree"):
        invariant_paged_attention(s.q[10:12], s.k, s.v, kv, mask, torch.arange(2), 0.125, [10], [2], False)


def test_backend_writes_the_cache_and_needs_begin_forward():
    from ddtree_serve.kernels.attention import AttentionMeta

    s = _Seq(torch.float32)
    q, kv, mask, qi = s.causal([(0, 5)])
    k_cache, v_cache = s.k.clone(), s.v.clone()
    be = InvariantAttentionBackend()
    with pytest.raises(RuntimeError):
        be.forward(q, s.k[1:6], s.v[1:6], k_cache, v_cache, torch.arange(1, 6), kv, mask, qi, 0.125)
    be.begin_forward(AttentionMeta(True, False, kv, mask, qi, torch.tensor([0]), torch.tensor([5])))
    out = be.forward(q, s.k[1:6] * 2, s.v[1:6], k_cache, v_cache, torch.arange(1, 6), kv, mask, qi, 0.125)
    assert torch.equal(k_cache[1:6], s.k[1:6] * 2) and out.shape == (5, 9, 64)
