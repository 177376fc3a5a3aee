"""GPU check: the fixed budget's tree build captured in a CUDA graph (speculative/tree_graphs.py) replays the eager
device build field for field, batch after batch (refilled static inputs, padded rows), and the capture holds no
host sync (torch.cuda.graph fails on one)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.cuda_graph_runner import CudaCapture
from ddtree_serve.speculative.ddtree import draft_topk
from ddtree_serve.speculative.tree_graphs import DeviceTreeBuilder
from tests.speculative.test_device_tree import FIELDS, _logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("chain", [False, True])
def test_tree_graph_replays_the_eager_build(chain: bool) -> None:
    graphed = DeviceTreeBuilder(CudaCapture(), (1, 2, 4, 8))
    budget, width = 16, 17
    for step, bs in enumerate((5, 7, 8, 5)):
        logits = _logits(bs, 15, 64, seed=step).cuda()  # [bs, L, V]
        topk = draft_topk(logits, 1 if chain else budget)
        max_depths = [15, 2, 0, 9, 1, 3, 4, 15][:bs]
        roots = torch.arange(bs, device="cuda") + step
        cached = torch.arange(bs, device="cuda") * 5 + step
        got = graphed.build(topk, budget, max_depths, chain, roots, cached, width)
        want = DeviceTreeBuilder().build(topk, budget, max_depths, chain, roots, cached, width)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
    assert graphed.replays == 4 and len(graphed.graphs) == 1
