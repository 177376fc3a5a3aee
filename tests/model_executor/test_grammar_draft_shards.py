"""Grammar masking of the drafter's logits per vocabulary shard (``mask_draft_logits`` with a ``VocabShard``, then
``draft_topk``'s top-k of top-k's): every rank's masked columns, the top-k tokens and the pops equal the gathered
path's, and every rank's grammar state walks the same top-1 path and comes back where it was. Ranks run as threads
exchanging through a barrier (tests/model_executor/test_sharded_sampling.py), the same code path as gloo ranks;
the engine at TP 2 and 4 on gloo: tests/parallel/test_tp_vocab_parallel.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ddtree_serve.model_executor.grammar import GrammarState, mask_draft_logits
from ddtree_serve.speculative.ddtree import draft_topk, pop_nodes
from tests.model_executor.conftest import GRAMMAR_EOS as EOS
from tests.model_executor.conftest import GRAMMAR_VOCAB as VOCAB
from tests.model_executor.test_sharded_sampling import _shards, _Threads

REGEXES = (r"[ab]{0,3}c", None, r"(ab|b)+c")  # request 1 is free
K = 16  # twice a budget of 8: masked requests pop twice their width


def _states(backend) -> list[GrammarState | None]:  # noqa: ANN001
    return [GrammarState(backend.compile("regex", r), (EOS,), VOCAB) if r else None for r in REGEXES]


def _logits(alphabet: list[int]) -> torch.Tensor:
    """[3, 4, V] random, with the alphabet's tokens raised so that the top-1 path walks the grammar a few steps."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(REGEXES), 4, VOCAB, generator=g)
    logits[:, :, alphabet] += 6.0 + torch.rand(len(REGEXES), 4, len(alphabet), generator=g)
    return logits


def _per_rank(logits: torch.Tensor, size: int, backend):  # noqa: ANN001
    """Every rank's (masked columns, top-k, states), ranks as threads."""
    threads = _Threads(size)
    shards = _shards(VOCAB, size, threads)
    states = [_states(backend) for _ in range(size)]  # each rank holds its own matchers
    out: list = [None] * size
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            local = logits[..., shards[r].start:shards[r].end].clone()  # [bs, L, V/tp]
            mask_draft_logits(states[r], local, shards[r])
            out[r] = (local, draft_topk(local, K, shards[r]), states[r])
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


@pytest.fixture(scope="module")
def alphabet(tok):
    return [tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "ab", "x")] + [EOS]


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_draft_masks_equal_gathered(backend, alphabet, size: int) -> None:
    logits = _logits(alphabet)
    gathered = logits.clone()
    ref_states = _states(backend)
    mask_draft_logits(ref_states, gathered)
    ref_lp, ref_ids = draft_topk(gathered, K)
    assert torch.isneginf(gathered[0, 1]).any() and torch.isneginf(gathered[2, 1]).any(), "depth 2 is masked"
    assert gathered[1].equal(logits[1]), "the free request is left alone"
    budgets = torch.tensor([K, K // 2, K])
    ref_pops = pop_nodes(gathered, budgets, topk=(ref_lp, ref_ids))
    ranks = _per_rank(logits, size, backend)
    for local, (lp, ids), states in ranks:
        fin = torch.isfinite(ref_lp)  # [bs, L, K] the -inf tail's ids (masked tokens) are any masked ones
        assert torch.equal(torch.isfinite(lp), fin) and torch.equal(ids[fin], ref_ids[fin])
        torch.testing.assert_close(lp[fin], ref_lp[fin], rtol=1e-6, atol=1e-5)  # float32 lse over ranks
        pops = pop_nodes(local, budgets, topk=(lp, ids))
        assert np.array_equal(pops.tokens, ref_pops.tokens) and np.array_equal(pops.parents, ref_pops.parents)
        for s in (states[0], states[2]):
            assert s.accepted == 0 and not s.terminated  # the walk came back
    cols = torch.cat([local for local, _, _ in ranks], -1)  # [bs, L, V]
    assert torch.equal(cols, gathered)  # the same -inf entries and the same finite logits
