"""The merged tree (ddtree_serve/speculative/draft_sources.py): one best-first order over DFlash pops and suffix drafts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ddtree_serve.speculative.ddtree import DFLASH, SUFFIX, PoppedNodes, assemble_tree, pop_nodes
from ddtree_serve.speculative.draft_sources import (
    accepted_by_source,
    merge_popped,
    no_pops,
    parse_sources,
    tag,
)


def _popped(rows: list[list[tuple[int, int, int, float]]]) -> PoppedNodes:
    """rows of (token, parent slot, depth, Q) in pop order."""
    bs, w = len(rows), max(len(r) for r in rows)
    out = PoppedNodes(np.zeros((bs, w), np.int64), np.full((bs, w), -1, np.int64), np.zeros((bs, w), np.int64),
                      np.full((bs, w), -np.inf), np.array([len(r) for r in rows], np.int64))
    for b, r in enumerate(rows):
        for i, (t, p, d, q) in enumerate(r):
            out.tokens[b, i], out.parents[b, i], out.depths[b, i], out.logws[b, i] = t, p, d, math.log(q)
    return out


def _paths(p: PoppedNodes, b: int) -> dict[tuple[int, ...], tuple[float, int]]:
    """prefix (tokens from the root) -> (Q of its source, source) of every node of row b."""
    out, seq = {}, {0: ()}
    for i in range(int(p.counts[b])):
        seq[i + 1] = seq[int(p.parents[b, i])] + (int(p.tokens[b, i]),)
        out[seq[i + 1]] = (math.exp(p.logws[b, i]), int(p.sources[b, i]))
    return out


def test_merge_takes_the_best_of_both_sources_under_one_budget():
    # DFlash: 5 (0.6) -> 6 (0.3); 7 (0.2). Suffix: 5 (0.9) -> 8 (0.8) -> 9 (0.7).
    draft = _popped([[(5, 0, 1, 0.6), (6, 1, 2, 0.3), (7, 0, 1, 0.2)]])
    suffix = tag(_popped([[(5, 0, 1, 0.9), (8, 1, 2, 0.8), (9, 2, 3, 0.7)]]), SUFFIX)
    m = merge_popped(draft, suffix, width=10)
    paths = _paths(m, 0)
    assert list(paths) == [(5,), (5, 8), (5, 8, 9), (5, 6), (7,)]  # descending score, parents first
    assert paths[(5,)] == (pytest.approx(0.9), SUFFIX)  # proposed by both: the larger term owns it
    assert paths[(5, 6)] == (pytest.approx(0.3), DFLASH)
    assert m.sources[0].tolist() == [SUFFIX, SUFFIX, SUFFIX, DFLASH, DFLASH]
    assert len(set(paths)) == int(m.counts[0])  # one node per prefix: sibling tokens stay distinct
    # a budget of 3 keeps the best three: a tree (prefix-closed)
    m3 = merge_popped(draft, suffix, width=3)
    assert list(_paths(m3, 0)) == [(5,), (5, 8), (5, 8, 9)]
    # calibration ratios reorder: suffix nodes worth a tenth
    scale = (np.ones((1, 4)), np.array([0.1]))  # (DFlash by depth, the suffix drafts' ratio at their match)
    ms = merge_popped(draft, suffix, width=10, scale=scale)
    order = list(_paths(ms, 0))
    assert order[:2] == [(5,), (5, 6)] and _paths(ms, 0)[(5,)][1] == DFLASH
    assert order.index((7,)) < order.index((5, 8))  # 0.2 > 0.1 * 0.8


def test_merge_keeps_a_child_below_its_parent():
    # a suffix child more probable than its DFlash-only parent is scored by the parent (s non-increasing)
    draft = _popped([[(5, 0, 1, 0.2)], [(1, 0, 1, 0.5)]])
    suffix = tag(_popped([[(5, 0, 1, 0.1), (6, 1, 2, 0.1)], [(2, 0, 1, 0.4)]]), SUFFIX)
    m = merge_popped(draft, suffix, width=4)
    assert [list(_paths(m, b)) for b in range(2)] == [[(5,), (5, 6)], [(1,), (2,)]]
    tree = assemble_tree(m, torch.from_numpy(m.counts), torch.tensor([3, 4]), torch.tensor([10, 20]), "cpu")
    assert tree.sources.tolist() == [[-1, DFLASH, SUFFIX], [-1, DFLASH, SUFFIX]]
    assert tree.tree_mask[0, 2].tolist() == [True, True, True]  # node (5, 6) sees its parent 5


def test_merge_with_real_pops_and_no_drafter():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 12, generator=g) * 3  # [bs, L, V]
    draft = pop_nodes(logits, torch.tensor([6, 6]))
    suffix = tag(_popped([[(int(draft.tokens[0, 0]), 0, 1, 0.99), (11, 1, 2, 0.98)], [(0, 0, 1, 0.05)]]), SUFFIX)
    m = merge_popped(draft, suffix, width=6)
    assert m.counts.tolist() == [6, 6]
    assert int((m.sources[0] == SUFFIX).sum()) == 2  # both suffix nodes outrank every other pop of row 0
    alone = merge_popped(no_pops(2), suffix, width=6)  # suffix drafts alone
    assert alone.counts.tolist() == [2, 1] and (alone.sources[alone.parents >= 0] == SUFFIX).all()


def test_accepted_by_source_and_parse():
    sources = np.array([[-1, SUFFIX, DFLASH, SUFFIX], [-1, DFLASH, SUFFIX, -1]])
    accept_index = np.array([[0, 1, 3], [0, 1, -1]])
    assert accepted_by_source(sources, accept_index, [2, 1]) == [2, 0]
    assert accepted_by_source(sources, accept_index, [1, 0]) == [1, 0]
    assert parse_sources("suffix, dflash") == ("dflash", "suffix")
    with pytest.raises(ValueError, match="draft_sources"):
        parse_sources("ngram")
