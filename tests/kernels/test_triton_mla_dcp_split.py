"""Split-K of the DCP Triton MLA kernel (ddtree_serve/kernels/triton_mla_dcp.py, stage 1 and merge in
ddtree_serve/kernels/triton_mla_split.py) under ``TRITON_INTERPRET=1``: at DCP 1, 2 and 4, for decode, extend after a
prefix and tree verify, with 1 to 64 splits (more splits than keys: most chunks empty), each rank's partial
output and log-sum-exp equal the torch reference's over its shard (``masked_paged_attention_lse`` over
``shard_keys``) and the merged partials equal full attention. The slots include a request whose keys all
live on rank 0 (the other ranks' shards are empty: output 0, lse -inf) and a decode token with no prefix (its
only key is on one rank); an fp8 cache against the reference over its dequantized rows; the planner
``choose_dcp_kv_splits`` and the launch's choice of the split path. 16-key tiles (a forced small shared memory)
so that a request spans several chunks. Tolerance: float32 1e-5 (online vs one-shot softmax)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import (
    masked_paged_attention,
    masked_paged_attention_lse,
    merge_attention_partials,
)
from ddtree_serve.kernels.kv_quant import dequantize_latent, quantize_latent
from ddtree_serve.model_executor.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from ddtree_serve.model_executor.layers.dcp_attention import shard_keys
from tests.kernels.test_triton_mla import _tree_mask

pytest.importorskip("triton")

from ddtree_serve.kernels.triton_mla_dcp import MLA_DCP_KERNELS  # noqa: E402
from ddtree_serve.kernels.triton_mla_plan import choose_dcp_kv_splits, choose_mla_tiles  # noqa: E402

LAT, ROPE, HEADS, SCALE = 32, 8, 5, 0.3
TILES = choose_mla_tiles(HEADS, LAT, ROPE, torch.float32, smem_limit=8_000)  # 16 x 16


def _dcp_case(mode: ForwardMode, prefix: list[int], extend: list[int], n: int, skew: int | None, seed: int,
              ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
    """Global slots of ``n`` DCP ranks: key ``j`` of a request on rank ``j % n`` (request ``skew``: all on
    rank 0), local rows from 1 up (0 is each rank's padding) -> (forward, full cache [ids, 1, W] by global id,
    q [T, H, W])."""
    g = torch.Generator().manual_seed(seed)
    total = [p + e for p, e in zip(prefix, extend, strict=True)]
    bs = len(prefix)
    table = torch.zeros(bs, max(total), dtype=torch.int64)  # [bs, K] global slots
    nxt = [1] * n  # next free local row per rank
    for b, tot in enumerate(total):
        for j in range(tot):
            r = 0 if b == skew else j % n
            table[b, j], nxt[r] = nxt[r] * n + r, nxt[r] + 1
    new_slots = torch.cat([table[b, prefix[b]:total[b]] for b in range(bs)])  # [T]
    tree = None
    if mode == ForwardMode.TARGET_VERIFY:
        q_max = max(extend)
        tree = torch.zeros(bs, q_max, q_max, dtype=torch.bool)
        for b, e in enumerate(extend):
            tree[b, :e, :e] = _tree_mask(e, g)
    t = sum(extend)
    zeros = torch.zeros(t, dtype=torch.int64)
    fb = build_forward_batch(mode, zeros, zeros, new_slots, table, torch.arange(bs), torch.tensor(prefix),
                             torch.tensor(extend), tree_mask=tree)
    full = torch.randn(max(nxt) * n, 1, LAT + ROPE, generator=g)  # [ids, 1, W]
    q = torch.randn(t, HEADS, LAT + ROPE, generator=g)  # [T, H, W]
    return fb, full, q


def _run(fb: ForwardBatch, q: torch.Tensor, cache: torch.Tensor, n: int, r: int, splits: int,
         scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return MLA_DCP_KERNELS[fb.mode.value](q, cache, fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens,
                                          fb.extend_lens, LAT, SCALE, fb.tree_mask, dcp_size=n, dcp_rank=r,
                                          k_scale=scales, tiles=TILES, num_splits=splits)


def _check_ranks(fb: ForwardBatch, q: torch.Tensor, full: torch.Tensor, n: int, splits: int,
                 deq: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> None:
    """Each rank's (o, lse) vs the reference over its shard, and the merge vs full attention. ``deq``: the
    dequantized view of an fp8 ``full`` (``scales`` its per-id scales)."""
    seen = full if deq is None else deq  # what the kernel must read, by global id
    outs, lses = [], []
    for r in range(n):
        sc = None if scales is None else scales[r::n].contiguous()
        o, lse = _run(fb, q, full[r::n].contiguous(), n, r, splits, sc)
        idx, mine = shard_keys(fb.kv_indices, n, r)
        loc = seen[r::n]
        ro, rlse = masked_paged_attention_lse(q, loc, loc[..., :LAT], idx, fb.attn_mask & mine[:, None], fb.q_index,
                                              SCALE)
        msg = f"{fb.mode} n={n} rank {r} splits {splits}"
        torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5, msg=msg)
        assert bool((torch.isinf(lse) == torch.isinf(rlse)).all()), msg
        fin = torch.isfinite(rlse)
        torch.testing.assert_close(lse[fin], rlse[fin], atol=1e-5, rtol=1e-5, msg=msg)
        assert bool((o[~fin] == 0).all()), msg  # no local visible key: output exactly 0
        outs.append(o)
        lses.append(lse)
    ref = masked_paged_attention(q, seen, seen[..., :LAT], fb.kv_indices, fb.attn_mask, fb.q_index, SCALE)
    merged = merge_attention_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, ref, atol=1e-5, rtol=1e-5, msg=f"{fb.mode} n={n} splits {splits} merged")


@pytest.mark.parametrize("splits,n", [(s, n) if (s, n) != (64, 4) else pytest.param(s, n, marks=pytest.mark.slow)
                                      for s in (1, 3, 64) for n in (1, 2, 4)])
def test_dcp_split_decode(n: int, splits: int) -> None:
    """Request 1 has no prefix (one key: ranks 1.. see nothing), request 3's keys all sit on rank 0.

    64 splits at DCP 4 is marked slow (~8 s of the interpreter): 64 splits at DCP 1 and 2 (more splits than any
    rank's keys: empty chunks) and 3 splits at DCP 4 (a rank with no key of a request; the n == 4 checks below)
    run in the default suite."""
    fb, full, q = _dcp_case(ForwardMode.DECODE, [37, 0, 50, 21], [1, 1, 1, 1], n, skew=3, seed=n + splits)
    _check_ranks(fb, q, full, n, splits)
    if n == 4:
        _, lse = _run(fb, q, full[1::n].contiguous(), n, 1, splits)
        assert bool(torch.isinf(lse[1]).all() and torch.isinf(lse[3]).all())


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("mode,prefix,extend,splits", [
    (ForwardMode.EXTEND, [0, 11, 30], [5, 9, 2], 1),  # the query-tiled extend kernel with the shard filter
    (ForwardMode.EXTEND, [0, 11, 30], [5, 9, 2], 4),
    (ForwardMode.TARGET_VERIFY, [12, 3, 30], [6, 5, 9], 3),
])  # fmt: skip
def test_dcp_split_extend_and_verify(n: int, mode: ForwardMode, prefix: list[int], extend: list[int],
                                     splits: int) -> None:
    fb, full, q = _dcp_case(mode, prefix, extend, n, skew=1, seed=7 * n + splits)
    _check_ranks(fb, q, full, n, splits)


@pytest.mark.parametrize("mode,splits", [(ForwardMode.DECODE, 5), (ForwardMode.TARGET_VERIFY, 2),
                                         (ForwardMode.EXTEND, 1)])
def test_dcp_split_fp8_cache(mode: ForwardMode, splits: int) -> None:
    n = 2
    prefix, extend = ([40, 9], [1, 1]) if mode == ForwardMode.DECODE else ([20, 6], [7, 4])
    fb, full, q = _dcp_case(mode, prefix, extend, n, skew=None, seed=splits)
    full[..., LAT:] *= 0.01  # the rope on another scale than the latent
    q8, sc = quantize_latent(full, LAT)  # [ids, 1, W] fp8, [ids, 2]
    _check_ranks(fb, q, q8, n, splits, dequantize_latent(q8, sc, LAT, torch.float32), sc)


def test_choose_dcp_kv_splits() -> None:
    """The shard's keys set the splits: batch 1 at 128k context and DCP 8 on 132 SMs takes 32 splits of
    >= 512 local keys; short shards, CPU (no SM count) and full launches take 1."""
    assert choose_dcp_kv_splits(1, 131_072, 132, 8) == 32
    assert choose_dcp_kv_splits(1, 131_072, 132, 1) == 64
    assert choose_dcp_kv_splits(1, 4_000, 132, 8) == 1  # 500 keys per rank
    assert choose_dcp_kv_splits(1, 131_072, None, 8) == 1
    assert choose_dcp_kv_splits(512, 131_072, 132, 8) == 1


def test_long_context_dcp_decode_takes_the_split_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-1 decode over 2,100 keys at DCP 2 on a GPU of 132 SMs (given: none on CPU) splits in 2 and
    matches the reference; on CPU (no SM count) it runs the single pass."""
    import ddtree_serve.kernels.triton_mla_dcp as td

    calls = []
    real = td.launch_split
    monkeypatch.setattr(td, "launch_split", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    fb, full, q = _dcp_case(ForwardMode.DECODE, [2099], [1], 2, skew=None, seed=5)
    args = (q, full[1::2].contiguous(), fb.kv_indices, fb.attn_mask, fb.q_index, fb.prefix_lens, fb.extend_lens,
            LAT, SCALE)
    single = MLA_DCP_KERNELS["decode"](*args, dcp_size=2, dcp_rank=1)
    assert calls == []
    monkeypatch.setattr(td, "device_sm_count", lambda *dev: 132)
    split = MLA_DCP_KERNELS["decode"](*args, dcp_size=2, dcp_rank=1)
    assert calls == [2]
    for a, b in zip(single, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
