"""The GPU tests build kernel arguments with tests/kernels/tree_helpers.py and move only the tree to CUDA:
every buffer the helpers create must follow the tree's device, or the kernels' device check raises
before any kernel runs (as it did for three GPU tests). Checked with a second device that exists
everywhere ("meta") through the same argument validation the kernels run first."""

from __future__ import annotations

import random

import torch

from ddtree_serve.kernels.speculative import _validate_tree
from tests.kernels.tree_helpers import greedy_args, pack_trees, random_tree, sampling_args

_TREE_ARGS = (
    "predicts",
    "accept_index",
    "accept_token_num",
    "candidates",
    "retrive_index",
    "retrive_next_token",
    "retrive_next_sibling",
)


def _tree_on(device: str):
    rng = random.Random(0)
    tree = pack_trees([random_tree(rng, 5, 8) for _ in range(3)], 6)
    return {k: v.to(device) for k, v in tree.items()}


def test_helper_buffers_follow_the_tree_device():
    tree = _tree_on("meta")
    greedy = greedy_args(tree, torch.zeros(3, 6, dtype=torch.int64, device="meta"), s=4)
    sampled = sampling_args(
        tree,
        torch.zeros(3, 6, device="meta"),
        torch.zeros(3, device="meta"),
        torch.zeros(3, 6, 10, device="meta"),
        s=4,
    )
    for args in (greedy, sampled):
        assert {t.device.type for t in args.values()} == {"meta"}
        assert _validate_tree(*(args[k] for k in _TREE_ARGS)) == (3, 6, 4)
