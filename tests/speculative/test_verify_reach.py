"""``ddtree_serve.speculative.verify.node_reach``: the probability that sampled verification accepts each tree node,
against the acceptance frequencies of both rules that verify with it: the coupled walk over position-keyed
tokens (N seeds) and sgl-kernel's target-only coin rule (Monte Carlo over the coins, both coin conventions):
the two rules accept each node equally often. Also by hand, at probabilities of exactly 0 and 1, and as
``verify_tree(want_reach=True)`` returns it for greedy, sampled and mixed batches."""

from __future__ import annotations

import pytest
import torch

import ddtree_serve.kernels.speculative as kspec
from ddtree_serve.model_executor.position_uniforms import SampleKeys
from ddtree_serve.speculative.ddtree import DraftTree, build_ddtree
from ddtree_serve.speculative.verify import (
    COIN_RULE_ENV,
    build_target_probs,
    node_reach,
    reference_coin_rule,
    verify_coins,
    verify_tree,
)


def _keys(seeds: list[int]) -> SampleKeys:
    return SampleKeys.build(seeds, [0] * len(seeds), torch.device("cpu"))


def _tree(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    bs = draft_logits.shape[0]
    return build_ddtree(draft_logits, torch.full((bs,), budget), torch.zeros(bs, dtype=torch.int64),
                        torch.full((bs,), 5, dtype=torch.int64))


def _params(bs: int, temp: float, top_k: int = -1, greedy: bool = False):
    return (torch.full((bs,), temp), torch.full((bs,), top_k, dtype=torch.int64), torch.full((bs,), 1.0),
            torch.full((bs,), greedy, dtype=torch.bool))


def _on_path(accept_index: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[bs, D] bool: slot i is on the accepted path."""
    ar = torch.arange(num_slots)
    return (accept_index[:, :, None] == ar[None, None, :]).any(1)


def _coin_rule_paths(tree: DraftTree, target: torch.Tensor, temp: float, top_k: int, n: int) -> torch.Tensor:
    """accept_index of sgl-kernel's target-only coin rule (thresholds 1, draft_probs 0), coins per request."""
    bs, d = tree.candidates.shape
    probs = build_target_probs(target, *_params(bs, temp, top_k))  # [bs, D, V]
    coins, final = verify_coins([torch.Generator().manual_seed(s) for s in range(n)], tree.num_nodes, d,
                                torch.zeros(bs, dtype=torch.bool), target.device)
    predicts = torch.full((bs * d,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, 1 + int(tree.depths.max())), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    kspec.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, tree.candidates, tree.retrive_index, tree.retrive_next_token,
        tree.retrive_next_sibling, coins, final, probs, torch.zeros_like(probs), deterministic=True,
        coin_rule=reference_coin_rule())
    base = (torch.arange(bs) * d)[:, None]
    return torch.where(accept_index >= 0, accept_index.long() - base, -1)


@pytest.mark.parametrize("top_k", [pytest.param(-1, marks=pytest.mark.slow), 3])
def test_reach_is_the_acceptance_frequency_of_both_rules(monkeypatch: pytest.MonkeyPatch, top_k: int) -> None:
    """One tree of 8 nodes over a vocabulary of 6, verified N = 20000 times: by the coupled walk (one seed
    each) and by the kernel's coin rule (independent coins, under both coin conventions). Each node's
    acceptance frequency matches ``node_reach`` within 4.5 binomial standard deviations (+ 1e-3) under both,
    with and without top-k (top-k zeroes tokens: reach exactly 0 there). The coupled walk (thresholds 1) does
    not read the coin convention, so it runs once and only the coin rule runs under each convention.

    Without top-k is marked slow (~15 s, the 20000-row sampling filter): the default suite's case (top-k 3)
    runs the same walk, coin rules and ``node_reach`` (top-k only zeroes some tokens' probabilities, and the
    kept nodes' frequencies are checked the same way); ``node_reach`` without a filter is checked by
    test_reach_by_hand and test_greedy_and_mixed_rows_get_the_realized_path, and sampled verification's law
    without a filter by tests/speculative/test_spec_engine.py's
    test_sampled_ddtree_matches_target_distribution[1.0--1-1.0]."""
    gen = torch.Generator().manual_seed(3)
    n, vocab, depth = 20000, 6, 3
    draft = torch.randn(1, depth, vocab, generator=gen) * 1.5
    one = _tree(draft, 8)
    d = one.num_slots
    target = torch.randn(1, d, vocab, generator=gen) * 1.3  # [1, D, V]
    tree = _tree(draft.expand(n, -1, -1).contiguous(), 8)
    many = target.expand(n, -1, -1).contiguous()
    res = verify_tree(tree, many, *_params(n, 0.8, top_k), _keys(list(range(n))), want_reach=True)
    probs = build_target_probs(target, *_params(1, 0.8, top_k))  # [1, D, V]
    reach = node_reach(one, probs)[0].double()  # [D]
    assert torch.allclose(res.node_reach, reach.float().expand(n, -1))  # every replica: the same reach
    assert reach[0] == 1.0 and float(reach[1:].sum()) > 0.3  # the tree is used
    tol = 4.5 * (reach * (1 - reach) / n).sqrt() + 1e-3
    for rule in (None, "le", "lt"):  # None: the coupled walk's paths; then the coin rule under each convention
        if rule is None:
            paths = res.accept_index
        else:
            monkeypatch.setenv(COIN_RULE_ENV, rule)
            paths = _coin_rule_paths(tree, many, 0.8, top_k, n)
        freq = _on_path(paths, d).double().mean(0)  # [D]
        assert ((freq - reach).abs() <= tol).all(), (rule, freq.tolist(), reach.tolist())
        if top_k > 0:  # some node's token is filtered out at its parent: never accepted, and exactly 0 predicted
            zero = reach == 0
            assert zero.any() and (freq[zero] == 0).all()


def test_reach_by_hand() -> None:
    """A chain root -> a -> b and a sibling c of a: reach(a) = p0(a), reach(b) = p0(a) pa(b), reach(c) = p0(c)
    (the sibling order does not matter: the coin's intervals are disjoint); unused slots 0."""
    vocab = 5
    draft = torch.full((1, 2, vocab), -9.0)
    draft[0, 0, 1], draft[0, 0, 2], draft[0, 1, 3] = 2.0, 1.0, 2.0  # depth 1: 1 then 2; depth 2: 3
    tree = _tree(draft, 3)
    probs = torch.zeros(1, tree.num_slots, vocab)
    probs[0, :, 4] = 1.0  # rows of nodes without children: irrelevant
    probs[0, 0] = torch.tensor([0.1, 0.5, 0.2, 0.0, 0.2])
    cand, par = tree.candidates[0].tolist(), tree.parents[0].tolist()
    a = next(i for i in range(1, 4) if par[i] == 0 and cand[i] == 1)
    c = next(i for i in range(1, 4) if par[i] == 0 and cand[i] == 2)
    b = next(i for i in range(1, 4) if par[i] == a)
    probs[0, a] = torch.tensor([0.0, 0.0, 0.0, 0.25, 0.75])
    reach = node_reach(tree, probs)[0]
    assert reach[0] == 1.0
    assert reach[a].item() == pytest.approx(0.5) and reach[c].item() == pytest.approx(0.2)
    assert reach[b].item() == pytest.approx(0.125)
    wide = _tree(torch.cat([draft, draft]), 3)  # budgets 3 and 1 in one batch: the second has unused slots
    narrow = build_ddtree(torch.cat([draft, draft]), torch.tensor([3, 1]), torch.zeros(2, dtype=torch.int64),
                          torch.full((2,), 5, dtype=torch.int64))
    assert wide.num_slots == narrow.num_slots
    r2 = node_reach(narrow, torch.cat([probs, probs]))
    assert r2[1, 2:].tolist() == [0.0, 0.0] and r2[1, 1].item() == pytest.approx(0.5)


def test_greedy_and_mixed_rows_get_the_realized_path() -> None:
    """Greedy rows: reach is the accepted path itself (0 / 1), in an all-greedy batch and in a mixed one
    (one-hot rows); thresholds below 1 (lossy): the realized path for every row."""
    gen = torch.Generator().manual_seed(5)
    bs, vocab = 6, 8
    draft = torch.randn(bs, 4, vocab, generator=gen)
    tree = _tree(draft, 10)
    target = torch.randn(bs, tree.num_slots, vocab, generator=gen)
    gens = [torch.Generator().manual_seed(s) for s in range(bs)]
    greedy = verify_tree(tree, target, *_params(bs, 0.0, greedy=True), want_reach=True)
    assert torch.equal(greedy.node_reach, _on_path(greedy.accept_index, tree.num_slots).float())
    temp, top_k, top_p, is_greedy = _params(bs, 1.0)
    is_greedy[::2] = True
    mixed = verify_tree(tree, target, temp, top_k, top_p, is_greedy, _keys(list(range(bs))), want_reach=True)
    assert torch.equal(mixed.node_reach[::2], greedy.node_reach[::2])
    sampled_rows = mixed.node_reach[1::2]
    assert ((sampled_rows > 0) & (sampled_rows < 1)).any()  # probabilities, not the draw
    lossy = verify_tree(tree, target, *_params(bs, 1.0), None, threshold_acc=0.5, want_reach=True, generators=gens)
    assert torch.equal(lossy.node_reach, _on_path(lossy.accept_index, tree.num_slots).float())
    assert verify_tree(tree, target, *_params(bs, 1.0), _keys(list(range(bs)))).node_reach is None  # when asked
