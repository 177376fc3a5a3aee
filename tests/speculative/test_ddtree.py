"""DDTree builder (arXiv 2604.12989, Algorithm 1): optimality by brute force, encoding invariants."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ddtree_serve.speculative.ddtree import DraftTree, build_ddtree


def _build(logits: torch.Tensor, budgets: list[int], chain: bool = False) -> DraftTree:
    bs = logits.shape[0]
    return build_ddtree(
        logits,
        torch.tensor(budgets, dtype=torch.int64),
        torch.arange(100, 100 + bs, dtype=torch.int64),
        torch.arange(10, 10 + bs, dtype=torch.int64) * 7,
        chain=chain,
    )


def _prefixes(tree: DraftTree, b: int) -> dict[tuple[int, ...], int]:
    """prefix (token path from the root, root excluded) -> slot, for every used node of request b."""
    n = int(tree.num_nodes[b])
    cand = tree.candidates[b].tolist()
    par = tree.parents[b].tolist()
    out: dict[tuple[int, ...], int] = {}
    for i in range(1, n + 1):
        path, j = [], i
        while j > 0:
            path.append(cand[j])
            j = par[j]
        out[tuple(reversed(path))] = i
    return out


def _brute_top(logits: torch.Tensor, budget: int) -> tuple[set[tuple[int, ...]], dict]:
    """All prefixes of length 1..L with their log-prob under Q = prod softmax; the top `budget`."""
    lp = torch.log_softmax(logits.double(), dim=-1).numpy()  # [L, V]
    depth, vocab = lp.shape
    scored = {}
    for d in range(1, depth + 1):
        for pre in itertools.product(range(vocab), repeat=d):
            scored[pre] = float(sum(lp[j, t] for j, t in enumerate(pre)))
    best = sorted(scored, key=lambda p: -scored[p])[:budget]
    return set(best), scored


def _check_invariants(tree: DraftTree, seq_lens: torch.Tensor | None = None) -> None:
    bs, d = tree.candidates.shape
    assert tree.tree_mask.shape == (bs, d, d)
    for f in ("candidates", "parents", "depths", "retrive_index", "retrive_next_token",
              "retrive_next_sibling", "positions"):
        assert getattr(tree, f).dtype == torch.int64, f
    assert tree.node_logws.dtype == torch.float32
    assert torch.equal(tree.retrive_index, torch.arange(bs * d).view(bs, d))
    for b in range(bs):
        n = int(tree.num_nodes[b])
        par = tree.parents[b].tolist()
        dep = tree.depths[b].tolist()
        lw = tree.node_logws[b].tolist()
        nxt = tree.retrive_next_token[b].tolist()
        sib = tree.retrive_next_sibling[b].tolist()
        assert par[0] == -1 and dep[0] == 0 and lw[0] == 0.0
        for i in range(1, n + 1):
            assert 0 <= par[i] < i, "parent < child"
            assert dep[i] == dep[par[i]] + 1
            assert lw[i] <= lw[par[i]] + 1e-6
        for i in range(n + 1, d):
            assert par[i] == -1 and dep[i] == 0 and lw[i] == float("-inf")
            assert nxt[i] == -1 and sib[i] == -1
        # Every used non-root node is reached exactly once through the links, from its own parent,
        # and siblings come in descending log-weight.
        seen: list[int] = []
        stack = [0]
        while stack:
            p = stack.pop()
            c, prev = nxt[p], None
            while c != -1:
                assert par[c] == p
                if prev is not None:
                    assert lw[c] <= lw[prev]
                seen.append(c)
                stack.append(c)
                prev, c = c, sib[c]
        assert sorted(seen) == list(range(1, n + 1))
        # Mask = ancestor closure (itself included); unused rows see only themselves.
        mask = tree.tree_mask[b]
        for i in range(d):
            expect = torch.zeros(d, dtype=torch.bool)
            expect[i] = True
            j = par[i]
            while j >= 0:
                expect[j] = True
                j = par[j]
            assert torch.equal(mask[i], expect), (b, i)
        if seq_lens is not None:
            assert torch.equal(tree.positions[b], seq_lens[b] + tree.depths[b])


@pytest.mark.parametrize("seed", range(6))
def test_tree_is_top_budget_prefixes(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = 4 + seed % 3
    depth = 3 + seed % 2
    budgets = list(range(1, 21))  # per-request budgets in one batch
    one = torch.randn(1, depth, vocab, generator=gen) * 1.5
    logits = torch.cat([one, torch.randn(len(budgets) - 1, depth, vocab, generator=gen) * 1.5])
    logits[1:4] = one  # same logits, different budgets: nested trees
    tree = _build(logits, budgets)
    _check_invariants(tree, torch.arange(10, 10 + len(budgets)) * 7)
    assert tree.num_slots == 1 + max(budgets)
    for b, budget in enumerate(budgets):
        best, scored = _brute_top(logits[b], budget)
        got = _prefixes(tree, b)
        assert int(tree.num_nodes[b]) == budget
        assert set(got) == best, (b, budget)
        for pre, slot in got.items():
            assert tree.node_logws[b, slot].item() == pytest.approx(scored[pre], abs=1e-5)
        assert int(tree.candidates[b, 0]) == 100 + b


def test_nested_budgets_share_prefix_order() -> None:
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(3)).repeat(3, 1, 1)
    tree = _build(logits, [5, 9, 17])
    # Pop order is budget independent: the smaller tree is the first slots of the larger one.
    for b in (0, 1):
        n = int(tree.num_nodes[b]) + 1
        assert torch.equal(tree.candidates[b, 1:n], tree.candidates[2, 1:n])
        assert torch.equal(tree.parents[b, :n], tree.parents[2, :n])


def test_budget_zero_is_root_only() -> None:
    logits = torch.randn(2, 3, 5)
    tree = _build(logits, [0, 0])
    assert tree.num_slots == 1
    assert tree.num_nodes.tolist() == [0, 0]
    assert tree.tree_mask.all() and tree.retrive_next_token.eq(-1).all()
    mixed = _build(logits, [0, 4])
    _check_invariants(mixed)
    assert mixed.num_nodes.tolist() == [0, 4]
    assert mixed.retrive_next_token[0].eq(-1).all()


def test_budget_larger_than_prefix_count_and_masked_tokens() -> None:
    logits = torch.randn(1, 2, 2)
    tree = _build(logits, [10])  # only 2 + 4 prefixes exist
    _check_invariants(tree)
    assert int(tree.num_nodes[0]) == 6
    masked = torch.randn(1, 3, 5)
    masked[0, :, 3:] = float("-inf")  # zero-probability tokens never enter the tree
    tree = _build(masked, [40])
    _check_invariants(tree)
    assert int(tree.num_nodes[0]) == 3 + 9 + 27
    assert not (tree.candidates[0, 1:] >= 3).any()


def test_deterministic_ties() -> None:
    logits = torch.zeros(2, 2, 3)  # every prefix of a depth ties
    a = _build(logits, [5, 5])
    b = _build(logits, [5, 5])
    assert torch.equal(a.candidates, b.candidates) and torch.equal(a.parents, b.parents)
    # Documented rule: token id ascending within a depth; shallower first; earlier parent first.
    assert a.candidates[0, 1:].tolist() == [0, 1, 2, 0, 1]
    assert a.parents[0, 1:].tolist() == [0, 0, 0, 1, 1]
    _check_invariants(a)


def test_chain_mode() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 7, generator=gen)
    tree = _build(logits, [2, 4, 9], chain=True)
    _check_invariants(tree)
    assert tree.num_nodes.tolist() == [2, 4, 4]  # min(L, budget)
    top1 = logits.argmax(-1)  # [bs, L]
    lp = torch.log_softmax(logits, -1).max(-1).values.cumsum(-1)  # [bs, L]
    for b, n in enumerate(tree.num_nodes.tolist()):
        assert tree.candidates[b, 1 : n + 1].tolist() == top1[b, :n].tolist()
        assert tree.parents[b, 1 : n + 1].tolist() == list(range(n))
        assert tree.retrive_next_sibling[b].eq(-1).all()
        assert tree.retrive_next_token[b, :n].tolist() == list(range(1, n + 1))
        assert torch.allclose(tree.node_logws[b, 1 : n + 1], lp[b, :n], atol=1e-5)


def test_chain_matches_tree_when_first_nodes_are_a_path() -> None:
    logits = torch.full((1, 3, 5), -8.0)
    logits[0, :, 2] = 8.0  # one dominant token per depth: the best tree is the chain
    tree = _build(logits, [3])
    chain = _build(logits, [3], chain=True)
    assert torch.equal(tree.candidates, chain.candidates)
    assert torch.equal(tree.parents, chain.parents)


def test_large_vocab_batch_shapes() -> None:
    logits = torch.randn(4, 15, 2048, generator=torch.Generator().manual_seed(0))
    budgets = [64, 0, 17, 33]
    tree = _build(logits, budgets)
    _check_invariants(tree)
    assert tree.num_nodes.tolist() == budgets
    assert np.isfinite(tree.node_logws[0, 1:].numpy()).all()
