"""The vocabulary-sharded reductions (``sharded_sampling``) equal the one-shard computation, and the one-shard
computation equals its definition (a sort-based oracle), at tiny shapes with ties and near-ties.

Shards run as threads that exchange through a barrier (``_Threads``): the same code path as gloo ranks, in
one process."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from ddtree_serve.model_executor.sharded_sampling import (
    FRAC_BITS,
    inverse_cdf_draw,
    kept_weights,
    sharded_argmax,
    sharded_draw,
)
from ddtree_serve.model_executor.vocab_shard import VocabShard


class _Threads:
    """``size`` ranks as threads: ``gather`` stacks every rank's tensor in rank order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def gather_of(self, rank: int):
        def gather(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            out = torch.stack(list(self.slots))  # type: ignore[arg-type]
            self.barrier.wait()
            return out
        return gather


def _shards(vocab: int, size: int, threads: _Threads) -> list[VocabShard]:
    w = -(-vocab // size)  # the LM head's split: ceil(V / tp) a rank, the last one short
    return [VocabShard(vocab, r * w, min((r + 1) * w, vocab), r, size, threads.gather_of(r)) for r in range(size)]


def _run_sharded(fn, logits: torch.Tensor, size: int):  # noqa: ANN001
    """``fn(local_logits, shard)`` on every rank (threads); every rank's result, in rank order."""
    threads = _Threads(size)
    shards = _shards(logits.shape[-1], size, threads)
    out: list = [None] * size
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            out[r] = fn(logits[:, shards[r].start:shards[r].end], shards[r])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            threads.barrier.abort()

    ts = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return out


def _tricky_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows with exact ties (repeated maxima across shard boundaries), near-ties (one ulp apart), -inf entries
    and a fully masked row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 2  # [n, V]
    x[0] = 1.0  # all tied
    x[1, [1, vocab // 2, vocab - 1]] = 9.0  # tied maxima in different shards
    x[2] = torch.round(x[2])  # many ties
    x[3, vocab // 3] = 5.0
    x[3, vocab - 2] = torch.nextafter(torch.tensor(5.0), torch.tensor(0.0))  # near-tie
    x[4, ::3] = float("-inf")
    x[5] = float("-inf")  # nothing allowed
    return x


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_argmax_ties_lowest_id(size: int) -> None:
    x = _tricky_logits(6, 37, 0)
    x = x[:5]  # an all -inf row has no meaningful argmax
    ref = x.argmax(-1)
    for got in _run_sharded(sharded_argmax, x, size):
        assert torch.equal(got, ref)
    assert int(ref[1]) == 1 and int(ref[0]) == 0


def _params(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    temp = torch.rand(n, generator=g) * 1.5 + 0.2  # [n]
    top_k = torch.randint(1, vocab + 3, (n,), generator=g)  # [n] some >= V (off)
    top_p = torch.where(torch.rand(n, generator=g) < 0.3, 1.0, torch.rand(n, generator=g))  # [n]
    top_p[0] = 0.0  # the max (and its ties) alone
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, torch.rand(n, generator=g) * 0.3)  # [n]
    u = torch.rand(n, generator=g, dtype=torch.float64)  # [n]
    u[1] = 1 - 2 ** -53  # at the top
    u[2] = 0.0
    return temp, top_k, top_p, min_p, u


@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sharded_draw_equals_one_shard(size: int, seed: int) -> None:
    n, vocab = 12, 53
    x = torch.cat([_tricky_logits(6, vocab, seed), torch.randn(6, vocab) * 0.01])  # near-uniform rows too
    temp, top_k, top_p, min_p, u = _params(n, vocab, seed)
    ref = sharded_draw(x, temp, top_k, top_p, min_p, u, VocabShard.whole(vocab))

    def draw(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        return sharded_draw(local, temp, top_k, top_p, min_p, u, shard)

    for got in _run_sharded(draw, x, size):
        assert torch.equal(got, ref)
    assert int(ref[5]) == vocab - 1  # a fully masked row: flashinfer's convention


def _oracle(x: torch.Tensor, temp: float, k: int, p: float, mp: float, u: float) -> int:
    """The module's definitions for one row, by sorting (no radix select, no shards)."""
    vocab = x.shape[0]
    m = x.max()
    m = m if torch.isfinite(m) else torch.tensor(0.0)
    e = torch.exp((x - m) / torch.tensor(temp, dtype=torch.float32)).nan_to_num(0.0)  # [V]
    q = (e.double() * 2.0 ** FRAC_BITS).floor().long()  # [V]
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < k < vocab:
        keep &= e >= e.sort(descending=True).values[k - 1]
    if p < 1.0:
        w = torch.where(keep, q, 0)
        target = max(1, math.ceil(float(torch.tensor(max(p, 0.0), dtype=torch.float64) * w.sum().double())))
        vals = e.sort(descending=True).values
        t = next((v for v in vals.tolist() if int(w[e >= v].sum()) >= target), 0.0)  # the largest reaching it
        keep &= e >= t
    if mp > 0:
        keep &= e >= torch.tensor(mp, dtype=torch.float32)
    qk = torch.where(keep, q, 0)
    s = int(qk.sum())
    if s == 0:
        return vocab - 1
    target = min(int(float(u) * float(s)), s - 1)
    return int((qk.cumsum(0) > target).nonzero()[0])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_one_shard_matches_sorted_definition(seed: int) -> None:
    n, vocab = 12, 41
    x = torch.cat([_tricky_logits(6, vocab, seed), torch.randn(6, vocab) * 0.01])
    temp, top_k, top_p, min_p, u = _params(n, vocab, seed)
    got = sharded_draw(x, temp, top_k, top_p, min_p, u, VocabShard.whole(vocab))
    want = [_oracle(x[i], float(temp[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]), float(u[i]))
            for i in range(n)]
    assert got.tolist() == want


def test_top_k_keeps_ties_and_draw_never_picks_weight_zero() -> None:
    vocab = 16
    x = torch.zeros(1, vocab)
    x[0, [3, 9]] = 2.0  # tied for first: top-k 1 keeps both
    x[0, 12] = 1.0
    one = torch.ones(1)
    qk, total = kept_weights(x, one, torch.tensor([1]), one, torch.zeros(1), VocabShard.whole(vocab))
    assert (qk[0] > 0).nonzero()[:, 0].tolist() == [3, 9]
    assert int(total[0]) == 2 << FRAC_BITS
    for u, tok in ((0.0, 3), (0.49, 3), (0.5, 9), (1 - 2 ** -53, 9)):
        assert int(inverse_cdf_draw(qk, torch.tensor([u], dtype=torch.float64), VocabShard.whole(vocab))) == tok


def test_full_rows_gathers_in_vocabulary_order() -> None:
    x = torch.arange(2 * 11, dtype=torch.float32).view(2, 11)
    for got in _run_sharded(lambda local, shard: shard.full_rows(local), x, 4):
        assert torch.equal(got, x)


@pytest.mark.parametrize("size", [2, 4])
def test_draft_topk_of_shard_topks(size: int) -> None:
    """The drafter's top-k over shards (top-k of the shards' top-k's, log-sum-exp of theirs) gives the gathered
    top-k's tokens in the same order (value desc, id asc) and its log-probs to float rounding; k may exceed a
    shard's width."""
    from ddtree_serve.speculative.ddtree import draft_topk

    g = torch.Generator().manual_seed(size)
    x = torch.randn(2, 3, 29, generator=g)  # [bs, L, V]
    x[0, 0, 7] = 6.0
    x[0, 0, [4, 20]] = 5.0  # a tie across shards inside the top-k: the lower id first (at the k-th place either)
    for k in (1, 5, 12):
        ref_lp, ref_ids = draft_topk(x, k)

        def topk(local: torch.Tensor, shard: VocabShard, k: int = k) -> tuple[torch.Tensor, torch.Tensor]:
            return draft_topk(local.view(2, 3, -1), k, shard)

        for lp, ids in _run_sharded(topk, x.view(6, 29), size):
            assert torch.equal(ids, ref_ids)
            torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)  # float32 log-sum-exps combined
    assert draft_topk(x, 3)[1][0, 0].tolist() == [7, 4, 20]


def test_radix_threshold_compact_and_full_passes_agree() -> None:
    """Passes 2-4 over the first digit's elements only (CPU) or over every element (CUDA: no size read back)
    find the same thresholds, and they are the definition's (the largest key whose suffix weight reaches the
    target)."""
    from ddtree_serve.model_executor.sharded_sampling import _radix_threshold, _weights

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=g) * 2
    x[0] = 1.0
    x[1, :150] = -0.5
    e, q = _weights(x, torch.full((9,), 0.8), VocabShard.whole(300))
    keys = e.view(torch.int32).long()
    target = torch.randint(1, 2 ** 41, (9,), generator=g)
    target[2] = q[2].sum() + 1  # out of reach: 0
    a = _radix_threshold(keys, q, target, VocabShard.whole(300), compact=True)
    b = _radix_threshold(keys, q, target, VocabShard.whole(300), compact=False)
    assert torch.equal(a, b) and int(a[2]) == 0
    for i in (0, 1, 3, 4):
        ks = sorted(set(keys[i].tolist()), reverse=True)
        want = next(k for k in ks if int(q[i][keys[i] >= k].sum()) >= int(target[i]))
        assert int(a[i]) == want
