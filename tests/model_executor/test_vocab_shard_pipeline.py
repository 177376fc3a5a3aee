"""The elementwise stages of the logits pipeline on vocabulary shards: penalties (plain and per tree node, path
tokens of other shards included) and grammar bitmasks give each shard exactly its columns of the whole row's
result. No exchange is involved, so each shard runs on its own."""

from __future__ import annotations

import torch

from ddtree_serve.model_executor.grammar.masks import apply_bitmask, apply_bitmask_cols
from ddtree_serve.model_executor.penalties import (
    BatchPenalties,
    TokenCounts,
    apply_penalties,
    apply_tree_penalties,
)
from ddtree_serve.model_executor.sampling_params import SamplingParams
from ddtree_serve.model_executor.vocab_shard import VocabShard

V = 45
CPU = torch.device("cpu")


def _shards(size: int) -> list[VocabShard]:
    w = -(-V // size)
    return [VocabShard(V, r * w, min((r + 1) * w, V), r, size) for r in range(size)]


def _penalties() -> BatchPenalties:
    params = [SamplingParams(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3,
                             logit_bias={2: 1.0, 30: -3.0, 44: 2.5}, min_tokens=3, min_tokens_ban=(40, 12)),
              SamplingParams(temperature=0, repetition_penalty=0.8)]
    counts = [TokenCounts([1, 2, 3, 25, 44], V, CPU), TokenCounts([7, 8, 23], V, CPU)]
    counts[0].add([3, 25, 25, 40])
    counts[1].add([23, 23])
    pen = BatchPenalties.build(params, counts, V, CPU, [1, 0])
    assert pen is not None and pen.ban is not None and pen.bias is not None
    return pen


def test_plain_penalties_per_shard() -> None:
    pen = _penalties()
    x = torch.randn(2, V) * 3  # [bs, V]
    whole = apply_penalties(x, pen)
    for size in (2, 3, 4):
        for sh in _shards(size):
            got = apply_penalties(sh.cols(x), pen.for_shard(sh))
            assert torch.equal(got, sh.cols(whole))


def test_tree_penalties_per_shard_with_path_tokens_elsewhere() -> None:
    pen = _penalties()
    bs, d = 2, 5
    candidates = torch.tensor([[40, 25, 3, 44, 10], [23, 7, 30, 30, 0]])  # [bs, D] path tokens in every shard
    parents = torch.tensor([[-1, 0, 1, 2, 0], [-1, 0, 1, 2, -1]])  # a chain and a sibling; last slot padding
    anc = torch.zeros(bs, d, d, dtype=torch.bool)  # [bs, D, D]
    for b in range(bs):
        for i in range(d):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                j = int(parents[b, j]) if j > 0 else -1
    is_node = parents >= 0
    x = torch.randn(bs, d, V) * 3  # [bs, D, V]
    whole = apply_tree_penalties(x, pen, candidates, anc, is_node)
    assert not torch.equal(whole, apply_tree_penalties(x, pen, candidates, anc & False, is_node))  # paths count
    for size in (2, 3, 4):
        for sh in _shards(size):
            got = apply_tree_penalties(sh.cols(x), pen.for_shard(sh), candidates, anc, is_node, sh)
            assert torch.equal(got, sh.cols(whole))


def test_bitmask_columns() -> None:
    g = torch.Generator().manual_seed(0)
    words = (V + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.randn(3, V)
    whole = x.clone()
    apply_bitmask(whole, bitmask, [0, 2])
    assert torch.isinf(whole[0]).any() and not torch.isinf(whole[1]).any()
    for size in (2, 4):
        for sh in _shards(size):
            local = sh.cols(x).clone()
            apply_bitmask_cols(local, bitmask, [0, 2], sh)
            assert torch.equal(local, sh.cols(whole))
