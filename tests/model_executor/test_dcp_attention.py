"""Decode context parallelism's math on one process: the KV of real slot placements (``KVSlots`` with
``shards`` = N, tree nodes placed by position) split into N rank-local caches, each rank's partial attention
with its log-sum-exp (``masked_paged_attention_lse`` over ``shard_keys``), merged by
``merge_attention_partials``, equals full attention over the unsharded cache: causal extend after a prefix,
decode, and tree verify with ancestor masks. Plus the slot layout itself and the start-up errors that do
not need a second process."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import (
    masked_paged_attention,
    masked_paged_attention_lse,
    merge_attention_partials,
)
from ddtree_serve.model_executor.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from ddtree_serve.model_executor.kv_slots import KVSlots
from ddtree_serve.model_executor.layers.dcp_attention import local_cache_loc, shard_keys

W, LAT, HEADS = 12, 8, 3  # latent width (kv_lora 8 + rope 4), query heads
PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # node 0: the root (last committed token's successor), then a 6-node tree


def _tree_mask(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor-or-self mask [n, n], depth [n]) of a tree given by parent indices."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.int64)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, depth


def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


def _forwards(slots: KVSlots) -> list[ForwardBatch]:
    """Over 2 requests: extend of 5 and 9 tokens, a chunk of 6 and 2 after them, one decode token each, then
    verify trees of 7 and 4 nodes (placed by their positions)."""
    rows = torch.tensor([slots.alloc_row(), slots.alloc_row()])
    lens = torch.tensor([5, 9])
    out = []
    loc = slots.place(rows, _zeros(2), lens)
    out.append(build_forward_batch(ForwardMode.EXTEND, _zeros(14), _zeros(14), loc, slots.table, rows, _zeros(2),
                                   lens))
    chunk = torch.tensor([6, 2])
    loc = slots.place(rows, lens, chunk)
    out.append(build_forward_batch(ForwardMode.EXTEND, _zeros(8), _zeros(8), loc, slots.table, rows, lens, chunk))
    cached = lens + chunk  # [11, 11]
    one = torch.ones(2, dtype=torch.int64)
    loc = slots.place(rows, cached, one)
    out.append(build_forward_batch(ForwardMode.DECODE, _zeros(2), cached, loc, slots.table, rows, cached, one))
    cached = cached + 1
    mask, depth = _tree_mask(PARENTS)
    n = len(PARENTS)
    tree_lens = torch.tensor([n, 4])
    tm = torch.zeros(2, n, n, dtype=torch.bool)
    tm[0], tm[1, :4, :4] = mask, mask[:4, :4]
    positions = torch.cat([cached[0] + depth, cached[1] + depth[:4]])  # [T]
    loc = slots.place(rows, cached, tree_lens, positions=positions)
    out.append(build_forward_batch(ForwardMode.TARGET_VERIFY, _zeros(n + 4), positions, loc, slots.table, rows, cached,
                                   tree_lens, tree_mask=tm))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_partials_merge_to_full_attention(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    slots = KVSlots(60, 4, 48, shards=n)
    full = torch.randn(slots.id_space, 1, W, generator=g)  # [ids, 1, W] the unsharded cache, by global id
    local = [full[r::n] for r in range(n)]  # rank r's cache: local slot l holds global id l * n + r
    for fb in _forwards(slots):
        q = torch.randn(fb.q_index.numel(), HEADS, W, generator=g)  # [T, H, W]
        ref = masked_paged_attention(q, full, full[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, 0.3)
        outs, lses = [], []
        for r in range(n):
            idx, mine = shard_keys(fb.kv_indices, n, r)
            assert bool((local[r][idx][mine] == full[fb.kv_indices][mine]).all())
            visible = fb.attn_mask & mine[:, None]  # [bs, Q, K]
            assert bool(visible.any()), "every rank holds some visible key"
            o, lse = masked_paged_attention_lse(q, local[r], local[r][..., :LAT], idx, visible, fb.q_index, 0.3)
            outs.append(o)
            lses.append(lse)
        merged = merge_attention_partials(torch.stack(outs), torch.stack(lses))  # [T, H, LAT]
        torch.testing.assert_close(merged, ref, atol=1e-5, rtol=1e-5, msg=f"{fb.mode}")


def test_lse_partial_of_one_shard_is_full_attention() -> None:
    """With every key local the partial is the attention itself, and its lse the log-sum-exp of the scores."""
    g = torch.Generator().manual_seed(0)
    slots = KVSlots(40, 2, 32)
    cache = torch.randn(slots.id_space, 1, W, generator=g)
    fb = _forwards(slots)[-1]
    q = torch.randn(fb.q_index.numel(), HEADS, W, generator=g)
    out, lse = masked_paged_attention_lse(q, cache, cache[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, 0.5)
    ref = masked_paged_attention(q, cache, cache[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, 0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    b0 = fb.q_index[0] // fb.max_q  # first token's request, query row 0
    s = (q[0] @ cache[fb.kv_indices[b0], 0].T) * 0.5  # [H, K]
    s = s.masked_fill(~fb.attn_mask[b0, 0][None], float("-inf"))
    torch.testing.assert_close(lse[0], torch.logsumexp(s, -1))


def test_placement_interleaves_positions_and_falls_back_when_a_rank_is_full() -> None:
    slots = KVSlots(16, 2, 16, shards=2)  # 8 slots per rank
    assert (slots.num_slots, slots.local_slots, slots.id_space) == (16, 8, 18)
    row = slots.alloc_row()
    loc = slots.place(torch.tensor([row]), torch.tensor([0]), torch.tensor([6]))  # positions 0..5
    assert (loc % 2).tolist() == [0, 1, 0, 1, 0, 1]
    assert local_cache_loc(loc, 2, 1).tolist() == [0, 1, 0, 2, 0, 3]  # rank 1's local slots, others -> padding
    tree = slots.place(torch.tensor([row]), torch.tensor([6]), torch.tensor([4]), positions=torch.tensor([6, 7, 7, 7]))
    assert (tree % 2).tolist() == [0, 1, 1, 1]  # a node's rank is its position's, not its table column's
    assert slots.free_per_rank() == [4, 2]
    slots.free(tree)
    # ranks hold 3 of 8 each: 8 more at an odd position -> 5 on rank 1, the 3 it cannot take on rank 0
    more = slots.place(torch.tensor([row]), torch.tensor([6]), torch.tensor([8]), positions=torch.full((8,), 7))
    assert more is not None and int((more % 2 == 1).sum()) == 5 and int((more % 2 == 0).sum()) == 3
    assert slots.num_free == 2 and slots.place(torch.tensor([row]), torch.tensor([14]), torch.tensor([3])) is None
    assert slots.allocated().tolist() == sorted(torch.cat([loc, more]).tolist())


def test_sharded_free_is_exact_and_atomic() -> None:
    slots = KVSlots(8, 1, 8, shards=2)
    a = slots.alloc(4)
    assert sorted((a % 2).tolist()) == [0, 0, 1, 1]
    with pytest.raises(RuntimeError, match="freed twice"):
        slots.free(torch.cat([a[:1], torch.tensor([1])]))  # global id 1: rank 1's padding slot
    assert slots.num_free == 4  # nothing was freed by the failed call
    slots.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        slots.free(a[:1])
    assert slots.num_free == 8


def test_start_up_errors_without_a_second_process(tmp_path) -> None:
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.model_executor.model_runner import ModelRunner
    from ddtree_serve.model_executor.models.dflash import DFlashDraftModel, drafter_group
    from ddtree_serve.model_executor.parallel_state import TPGroup
    from ddtree_serve.server.config import ParallelArgs
    from ddtree_serve.server.engine import Engine
    from tests.conftest import write_tiny_llama_family

    with pytest.raises(ValueError, match="decode_context_parallel_size 3 must divide tp_size 4"):
        ParallelArgs(tp_size=4, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="decode_context_parallel_size 2 must divide tp_size 1"):
        Engine("default", device="cpu", decode_context_parallel_size=2)
    assert ParallelArgs(tp_size=4, decode_context_parallel_size=2).decode_context_parallel_size == 2
    llama = write_tiny_llama_family(tmp_path / "llama", "llama", vocab=64, seed=0)
    cfg = ModelConfig.load(str(llama), "float32", "cpu")
    with pytest.raises(ValueError, match="needs an MLA model"):
        ModelRunner(cfg, 2, 32, tp=TPGroup(0, 2, dcp_size=2), max_total_tokens=64)
    tp = TPGroup(0, 2, dcp_size=2)
    assert drafter_group({"num_key_value_heads": 2, "num_attention_heads": 4}, tp).dcp_size == 1
    with pytest.raises(ValueError, match="unsharded KV cache"):
        DFlashDraftModel(cfg, tp)


class _PlacedSeq:
    """A token sequence's latents ``lat [P, 1, W]`` and queries ``q [P, HEADS, W]`` by position (bfloat16), placed
    into a fresh ``KVSlots`` with ``shards`` DCP ranks per scenario (so local slot numbers differ between
    scenarios while each position stays on rank ``position % shards``)."""

    def __init__(self, shards: int, n: int = 140):
        g = torch.Generator().manual_seed(shards)
        self.lat = torch.randn(n, 1, W, generator=g).bfloat16()
        self.q = torch.randn(n, HEADS, W, generator=g).bfloat16()
        self.shards = shards
        self.slots = KVSlots(4 * n, 4, 2 * n, shards=shards)
        self.full = torch.zeros(self.slots.id_space, 1, W, dtype=torch.bfloat16)  # [ids, 1, W] by global id
        self.row = self.slots.alloc_row()

    def forward(self, mode: ForwardMode, prefix: int, lat: torch.Tensor, q: torch.Tensor, positions: torch.Tensor,
                tree: torch.Tensor | None = None) -> torch.Tensor:
        """Place and write ``lat`` [E, 1, W] at ``positions`` after ``prefix`` cached tokens, then the merged
        invariant attention of ``q`` [E, HEADS, W] over the ranks -> [E, HEADS, LAT]."""
        from ddtree_serve.kernels.mla_invariant import invariant_latent_totals
        from ddtree_serve.model_executor.layers.dcp_attention import merge_totals_ordered

        e = lat.shape[0]
        rows, pre, ext = torch.tensor([self.row]), torch.tensor([prefix]), torch.tensor([e])
        loc = self.slots.place(rows, pre, ext, positions=positions)
        self.full[loc] = lat
        fb = build_forward_batch(mode, _zeros(e), positions, loc, self.slots.table, rows, pre, ext,
                                 tree_mask=None if tree is None else tree[None])
        n = self.shards
        totals, maxes = [], []
        for r in range(n):
            idx, mine = shard_keys(fb.kv_indices, n, r)
            tot, m = invariant_latent_totals(q, self.full[r::n], None, fb.attention_meta(), LAT, 0.3, key_ok=mine,
                                             kv_indices=idx)
            totals.append(tot)
            maxes.append(m)
        return merge_totals_ordered(torch.stack(totals), torch.stack(maxes))

    def causal(self, start: int, stop: int) -> torch.Tensor:
        mode = ForwardMode.DECODE if stop - start == 1 and start else ForwardMode.EXTEND
        return self.forward(mode, start, self.lat[start:stop], self.q[start:stop], torch.arange(start, stop))


@pytest.mark.parametrize("n", [2, 3])
def test_invariant_dcp_row_is_the_same_in_a_chunk_a_decode_and_a_tree(n: int) -> None:
    """Deterministic mode's DCP path (``merge_totals_ordered`` over the ranks' ``invariant_latent_totals``): a
    position's merged latent attention is bit-identical from one 120-token prefill, a chunked prefill split
    off the 64-key splits, a decode row, and an on-path tree node (siblings on the same ranks as their depth's
    position); and equals the unsharded attention up to rounding."""
    one = _PlacedSeq(n)
    full = one.causal(0, 120)  # [120, H, LAT]
    ref = masked_paged_attention(one.q[:120].float(), one.lat[:120].float(), one.lat[:120, :, :LAT].float(),
                                 torch.arange(120)[None], torch.ones(120, 120, dtype=torch.bool).tril()[None],
                                 torch.arange(120), 0.3)
    torch.testing.assert_close(full.float(), ref, atol=2e-2, rtol=0)
    chunked = _PlacedSeq(n)
    parts = [chunked.causal(0, 37), chunked.causal(37, 101), chunked.causal(101, 102), chunked.causal(102, 103)]
    assert torch.equal(torch.cat(parts), full[:103])
    mask, depth = _tree_mask(PARENTS)  # on-path nodes 0 -> 1 -> 3 (depths 0, 1, 2), the others siblings
    on_path = [0, 1, 3]
    g = torch.Generator().manual_seed(9)
    lat = torch.randn(len(PARENTS), 1, W, generator=g).bfloat16()
    q = torch.randn(len(PARENTS), HEADS, W, generator=g).bfloat16()
    lat[on_path], q[on_path] = one.lat[103:106], one.q[103:106]
    tree = chunked.forward(ForwardMode.TARGET_VERIFY, 103, lat, q, 103 + depth, mask)
    assert torch.equal(tree[on_path], full[103:106])
