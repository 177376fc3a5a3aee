"""The installed sgl-kernel's acceptance rule is the one ``ddtree_serve.kernels.speculative.PINNED_COIN_RULE`` records
(issue 14, item 1). A coin of exactly 0 with a first child of probability 0 separates the rules: under
``coin <= acc`` (``le``) the child is accepted, under ``coin < acc`` (``lt``) it is not. Also checks that
verification's greedy coins (1) walk the argmax on the real kernel."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.dispatch import SGL_KERNEL, use_cuda_kernels
from ddtree_serve.kernels.speculative import PINNED_COIN_RULE
from tests.kernels.tree_helpers import pack_trees, run_sampling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cuda(d: dict) -> dict:
    return {k: v.cuda() for k, v in d.items()}


def test_installed_kernel_uses_the_pinned_coin_rule():
    if not use_cuda_kernels(torch.zeros(1, device="cuda"), library=SGL_KERNEL):
        pytest.skip("sgl-kernel not usable (not installed or DDTREE_KERNELS=torch)")
    tree = pack_trees([([-1, 0, 0], [0, 1, 2])], d=3)
    target = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4]])
    coins, final = torch.zeros(1, 3), torch.tensor([0.5])
    got = run_sampling(_cuda(tree), coins.cuda(), final.cuda(), target.cuda())
    rule = "le" if got["accept_index"].cpu().tolist() == [[0, 1]] else "lt"
    assert rule == PINNED_COIN_RULE, f"the installed sgl-kernel accepts with {rule!r}"
    ref = run_sampling(tree, coins, final, target)  # the reference under its default, the pinned rule
    assert ref["accept_index"].tolist() == got["accept_index"].cpu().tolist()


def test_greedy_coin_one_walks_the_argmax_on_cuda():
    if not use_cuda_kernels(torch.zeros(1, device="cuda"), library=SGL_KERNEL):
        pytest.skip("sgl-kernel not usable (not installed or DDTREE_KERNELS=torch)")
    tree = pack_trees([([-1, 0, 0, 2], [0, 4, 3, 1])], d=4)
    target = torch.zeros(1, 4, 6)
    target[0, 0, 3] = target[0, 2, 1] = target[0, 3, 5] = target[0, 1, 0] = 1.0
    got = run_sampling(_cuda(tree), torch.ones(1, 4).cuda(), torch.tensor([0.5]).cuda(), target.cuda())
    assert got["accept_index"].cpu().tolist() == [[0, 2, 3]]
    assert got["predicts"].cpu()[[0, 2, 3]].tolist() == [3, 1, 5]
