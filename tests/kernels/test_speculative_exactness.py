"""Exactness of the sampled tree-verification reference (Monte Carlo against the exact law of sequential
sampling from the target), under both coin rules; split from test_speculative_kernels.py."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_serve.kernels.sampling import top_k_renorm_prob, top_p_renorm_prob
from tests.kernels.tree_helpers import (
    pack_trees,
    random_tree,
    run_sampling,
)

# ----------------------------------------------------------------------------- exactness


def exact_outcomes(parents, tokens, target_row, s, vocab) -> torch.Tensor:
    """P(last accepted node = n, bonus = x) under sequential sampling from the target. [D * V]"""
    d = len(parents)
    children = {i: {tokens[c]: c for c in range(1, d) if parents[c] == i} for i in range(d)}
    probs = torch.zeros(d * vocab, dtype=torch.float64)

    def visit(node, depth, mass):
        for x in range(vocab):
            px = float(target_row[node, x]) * mass
            if px == 0:
                continue
            if depth < s - 1 and x in children[node]:
                visit(children[node][x], depth + 1, px)
            else:
                probs[node * vocab + x] += px

    visit(0, 0, 1.0)
    return probs


def aligned_rows(parents, tokens, vocab, seed) -> torch.Tensor:
    """Target rows [D, V] that favour the drafted children (a drafter that is often right)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(parents), vocab, generator=g)  # [D, V]
    for c in range(1, len(parents)):
        logits[parents[c], tokens[c]] += 1.5
    return logits.softmax(-1)


def empirical_outcomes(parents, tokens, target_row, s, vocab, n, seed, **kw) -> torch.Tensor:
    d = len(parents)
    one = pack_trees([(parents, tokens)], d)
    tree = {k: v.expand(n, d).contiguous() for k, v in one.items()}
    tree["retrive_index"] = torch.arange(n * d).view(n, d)
    g = torch.Generator().manual_seed(seed)
    target = target_row.expand(n, d, vocab).contiguous()
    coins = 1.0 - torch.rand(n, d, generator=g)  # (0, 1], as ddtree_serve/speculative/verify.py draws them
    out = run_sampling(tree, coins, torch.rand(n, generator=g), target, s=s, **kw)
    ar = torch.arange(n)
    last = out["accept_index"][ar, out["accept_token_num"].long()].long()  # global row
    bonus = out["predicts"][last].long()
    key = (last - ar * d) * vocab + bonus
    return torch.bincount(key, minlength=d * vocab).double() / n


N_MC = 40_000
TV_TOL = 0.03  # expected TV of the empirical law at N_MC draws and <= 60 outcomes is ~0.013


@pytest.mark.parametrize("rule", ["le", "lt"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("filtered", [False, True])
def test_sampling_reproduces_target_distribution(seed, filtered, rule):
    """Exact under both acceptance rules with tree coins in (0, 1] (filtered rows hold zeros, where a
    coin of 0 would matter)."""
    rng = random.Random(seed)
    vocab = 6
    parents, tokens = random_tree(rng, 9, vocab)
    rows = aligned_rows(parents, tokens, vocab, 100 + seed)
    if filtered:  # what the sampler does before verification: top-k then top-p renormalisation
        rows = top_p_renorm_prob(top_k_renorm_prob(rows, 5), 0.9)
        assert (rows == 0).any()
    depth = [0] * 9
    for i in range(1, 9):
        depth[i] = depth[parents[i]] + 1
    for s in {max(depth) + 1, max(2, max(depth))}:
        exact = exact_outcomes(parents, tokens, rows, s, vocab)
        emp = empirical_outcomes(parents, tokens, rows, s, vocab, N_MC, seed, coin_rule=rule)
        tv = 0.5 * (exact - emp).abs().sum().item()
        assert tv < TV_TOL, (s, tv)


def test_exactness_check_has_power():
    """A lossy setting (always accept a positive child) is far from the target law."""
    rng = random.Random(5)
    parents, tokens = random_tree(rng, 9, 6)
    rows = aligned_rows(parents, tokens, 6, 5)
    s = 5
    exact = exact_outcomes(parents, tokens, rows, s, 6)
    emp = empirical_outcomes(parents, tokens, rows, s, 6, 20_000, 0, threshold_single=0.0)
    assert 0.5 * (exact - emp).abs().sum().item() > 0.1


