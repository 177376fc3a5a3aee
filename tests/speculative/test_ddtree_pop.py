"""The batched best-first pops equal Algorithm 1's heap (``reference_pops``) bit for bit: tokens, parents,
depths, log-weights and counts, ties and zero-probability tokens included, per-request budgets and depth
limits; the chain mode equals the top-1 path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree_serve.speculative.ddtree import pop_nodes
from ddtree_serve.speculative.ddtree_pop import batched_chain, batched_pops, reference_pops


def _pops(lp, ids, budgets, limits):  # noqa: ANN001, ANN202
    return batched_pops(torch.from_numpy(lp), torch.from_numpy(ids), np.asarray(budgets), np.asarray(limits))


def _draft(rng: np.random.Generator, bs: int, depth: int, k: int, ties: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth sorted top-K log-probs [bs, L, K] (optionally from a small set of values: many ties; some
    -inf tails) and distinct token ids."""
    if ties:
        lp = np.log(rng.choice([0.5, 0.25, 0.125, 1 / 16], size=(bs, depth, k)))
    else:
        lp = np.log(rng.dirichlet(np.ones(k) * 0.3, size=(bs, depth)) + 1e-300)
    lp = -np.sort(-lp, axis=-1)
    zero = rng.random((bs, depth)) < 0.2  # a tail of zero-probability ranks
    cut = rng.integers(1, k + 1, size=(bs, depth))
    lp[zero[..., None] & (np.arange(k) >= cut[..., None])] = -np.inf
    lp[rng.random((bs, depth)) < 0.03, 0] = -np.inf  # a depth with no token at all
    lp = -np.sort(-lp, axis=-1)
    ids = np.stack([rng.permutation(1000)[:k] for _ in range(bs * depth)]).reshape(bs, depth, k)
    return lp, ids


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_batched_pops_equal_the_heap(seed: int, ties: bool) -> None:
    rng = np.random.default_rng(seed)
    bs, depth, k = 7, int(rng.integers(1, 9)), int(rng.integers(1, 40))
    lp, ids = _draft(rng, bs, depth, k, ties)
    budgets = rng.integers(0, 48, size=bs)
    limits = rng.integers(0, depth + 1, size=bs)
    tokens, parents, depths, logws, counts = _pops(lp, ids, budgets, limits)
    for b in range(bs):
        kb = min(int(budgets[b]), k)
        ref = reference_pops(lp[b, : limits[b], :kb].tolist(), ids[b, : limits[b], :kb].tolist(), int(budgets[b]), kb)
        n = len(ref[0])
        assert counts[b] == n, (b, counts[b], n)
        assert tokens[b, :n].tolist() == ref[0] and parents[b, :n].tolist() == ref[1]
        assert depths[b, :n].tolist() == ref[2] and logws[b, :n].tolist() == ref[3]  # exact floats
        assert (parents[b, n:] == -1).all() and (depths[b, n:] == 0).all() and np.isneginf(logws[b, n:]).all()


def test_batched_pops_depth_and_width_edges() -> None:
    lp = np.log(np.array([[[0.6, 0.4], [0.9, 0.1]]]))  # [1, 2, 2]
    ids = np.array([[[5, 6], [7, 8]]])
    tokens, parents, depths, _, counts = _pops(lp, ids, np.array([3]), np.array([2]))
    # 0.6 (5), 0.6*0.9=0.54 (5->7), 0.4 (6)
    assert counts.tolist() == [3] and tokens[0].tolist() == [5, 7, 6] and parents[0].tolist() == [0, 1, 0]
    assert depths[0].tolist() == [1, 2, 1]
    out = _pops(lp, ids, np.array([0]), np.array([2]))
    assert out[4].tolist() == [0] and out[0].shape == (1, 0)


def test_batched_chain_is_the_top1_path() -> None:
    lp = np.log(np.array([[[0.5], [0.5], [0.5]], [[0.5], [1.0], [0.5]]]))  # [2, 3, 1]
    lp[1, 1, 0] = -np.inf  # row 1 stops at depth 2 (a zero-probability token)
    ids = np.array([[[1], [2], [3]], [[4], [5], [6]]])
    tokens, parents, depths, logws, counts = batched_chain(lp, ids, np.array([2, 3]), np.array([3, 3]))
    assert counts.tolist() == [2, 1]
    assert tokens.tolist() == [[1, 2, 0], [4, 0, 0]] and parents.tolist() == [[0, 1, -1], [0, -1, -1]]
    assert depths.tolist() == [[1, 2, 0], [1, 0, 0]] and logws[0, :2].tolist() == [np.log(0.5), 2 * np.log(0.5)]


def test_pop_nodes_on_cpu_runs_the_heap_with_the_same_result() -> None:
    """pop_nodes (the heap on a CPU) and batched_pops (the accelerator path) agree on drafter logits."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, 300, generator=gen) * 3  # [bs, L, V]
    budgets, limits = torch.tensor([0, 1, 7, 30, 64]), torch.tensor([6, 2, 6, 0, 5])
    popped = pop_nodes(logits, budgets, max_depths=limits)
    from ddtree_serve.speculative.ddtree import draft_topk

    lp, ids = draft_topk(logits, 64)
    tokens, parents, depths, logws, counts = batched_pops(lp, ids, torch.where(limits > 0, budgets, 0).numpy(),
                                                          limits.numpy())
    assert popped.counts.tolist() == counts.tolist() == [0, 1, 7, 0, 64]
    for got, want in ((popped.tokens, tokens), (popped.parents, parents), (popped.depths, depths),
                      (popped.logws, logws)):
        assert np.array_equal(got, want)
