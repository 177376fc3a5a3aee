"""The fixed budget's tree built on the device (``ddtree.build_device_tree``: ``device_pops`` / ``device_chain`` then
``assemble_device_tree``, nothing read back; docs/DESIGN.md 4.17) equals the tree the host assembles from the pops
read back (``pop_nodes`` + ``assemble_tree``), field for field, ties, zero-probability tokens and depth caps
included; and a speculative engine that takes the device path stays lossless (greedy and seeded == plain
decoding, float32, drafts accepted)."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.model_runner import ModelRunner
from ddtree_serve.server.engine import Engine
from ddtree_serve.speculative.ddtree import assemble_tree, draft_topk, pop_nodes
from ddtree_serve.speculative.tree_graphs import DeviceTreeBuilder
from tests.model_executor.graph_capture_standin import RecordingCapture
from tests.speculative.test_seeded_lossless import _check

FIELDS = ("candidates", "parents", "depths", "node_logws", "num_nodes", "retrive_index", "retrive_next_token",
          "retrive_next_sibling", "positions", "tree_mask")


def _logits(bs: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=g)  # [bs, L, V]
    logits[0, :, :4] = 2.0  # ties among the top tokens
    logits[1 % bs, 1, :] = float("-inf")  # a depth with one possible token: the others have probability 0
    logits[1 % bs, 1, 3] = 0.0
    logits[-1, 2:, 5:] = float("-inf")  # few tokens at depth >= 3
    return logits


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("budget,width_extra", [(1, 0), (7, 0), (16, 3), (40, 0)])
def test_device_tree_equals_the_host_assembled_tree(chain: bool, budget: int, width_extra: int) -> None:
    bs, depth, vocab = 5, 6, 12
    logits = _logits(bs, depth, vocab, seed=budget)
    max_depths = [6, 3, 0, 1, 9][:bs]  # a request with no room for a node, one with depth 1, one past L
    roots = torch.arange(bs) + 100  # [bs]
    cached = torch.tensor([7, 20, 3, 11, 5])  # [bs]
    k = 1 if chain else min(budget, vocab)
    topk = draft_topk(logits, k)
    width = budget + 1 + width_extra
    tree = DeviceTreeBuilder().build(topk, budget, max_depths, chain, roots, cached, width)
    budgets = torch.full((bs,), budget)
    popped = pop_nodes(logits, budgets, chain=chain, max_depths=torch.tensor(max_depths), topk=topk, batched=False)
    want = assemble_tree(popped, budgets, roots, cached, "cpu", width=width)
    assert tree.on_host is None and tree.sources is None
    for name in FIELDS:
        got, ref = getattr(tree, name), getattr(want, name)
        assert got.dtype == ref.dtype and torch.equal(got, ref), name
    assert tree.max_depth >= want.max_depth  # a bound: the walk covers every node
    assert int(tree.num_nodes[2]) == 0 and int(tree.num_nodes.max()) > 0


def test_device_tree_refuses_a_width_without_room() -> None:
    topk = draft_topk(_logits(2, 3, 8, seed=0), 4)
    with pytest.raises(ValueError, match="cannot hold"):
        DeviceTreeBuilder().build(topk, 4, [3, 3], False, torch.zeros(2, dtype=torch.int64),
                                  torch.zeros(2, dtype=torch.int64), 4)


@pytest.mark.parametrize("chain", [False, True])
def test_graphed_builds_equal_eager_builds(chain: bool) -> None:
    """Replays of one captured graph (static inputs refilled, padded rows with no node) give the eager tree, batch
    after batch, for two batch sizes that pad to the same captured size."""
    capture = RecordingCapture()
    graphed = DeviceTreeBuilder(capture, (1, 2, 4, 8))
    budget, width = 6, 9
    for step, bs in enumerate((5, 7, 5)):
        topk = draft_topk(_logits(bs, 5, 10, seed=step), 1 if chain else budget)
        max_depths = [5, 2, 0, 9, 1, 3, 4][:bs]
        roots, cached = torch.arange(bs) + 7 * step, torch.arange(bs) * 3 + step
        got = graphed.build(topk, budget, max_depths, chain, roots, cached, width)
        want = DeviceTreeBuilder().build(topk, budget, max_depths, chain, roots, cached, width)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
    assert capture.events == ["warm_up", "capture", "replay", "replay", "replay"] and graphed.replays == 3
    assert len(graphed.graphs) == 1


@pytest.fixture
def device_path(monkeypatch) -> list[int]:
    """The engine's runner reports an accelerator (its step takes the device paths, as on a GPU); records the
    batch size of every tree built on the device."""
    built: list[int] = []
    real = DeviceTreeBuilder.build

    def spy(self, topk, *args, **kwargs):
        built.append(int(topk[0].shape[0]))
        return real(self, topk, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "accelerated", property(lambda self: True))
    monkeypatch.setattr(DeviceTreeBuilder, "build", spy)
    return built


def test_device_tree_engine_is_lossless(plain_refs, default_model_path, device_path):
    """Greedy, seeded, penalties and a mixed batch at budget 16 equal plain decoding with every tree built on the
    device (a grammar batch takes the host path, which is checked too)."""
    ids, refs = plain_refs
    spec = Engine(default_model_path, dtype="float32", max_total_tokens=16384, speculative_algorithm="ddtree",
                  draft_model_path="default", ddtree_budget=16, speculative_draft_sources="dflash")
    try:
        device_path.clear()
        _check(spec, ids, refs, ["sampled", "penalties", "mixed"])
        assert device_path and max(device_path) == 4, device_path
    finally:
        spec.shutdown()
