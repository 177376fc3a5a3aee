"""The graphed draft (speculative/draft_graphs.py, docs/DESIGN.md 4.17): ``DFlashDraftModel.forward_block`` (static
device inputs, block K/V kept as tensors, ``kernels/dflash_attention.py``) drafts what the eager ``draft_forward``
drafts (float32, 1e-5) on a tiny random DFlash checkpoint, for sliding + full layers, causal or not, with and without
the draft-window cap, and full layers alone, batch after batch through one padded graph, taking no KV slot; under
the simulated device a graphed draft step is one replay, syncs nothing, and gives the eager draft's logits."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.model_executor.kv_cache import KVCache
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner, load_model
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.server.engine import Engine
from ddtree_serve.sim.checkpoint import write_simulated_pair
from ddtree_serve.speculative.draft_graphs import DraftGraphs, graphed_draft
from ddtree_serve.speculative.tree_forward import draft_forward
from ddtree_serve.speculative.tree_graphs import ReplayByRunning
from tests.conftest import write_tiny_llama_family
from tests.speculative.drafter_utils import write_random_drafter

BLOCK = 4
SLIDE_FULL = {"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True, "sliding_window": 5}
KINDS = {  # name -> (drafter config keys, draft-window cap)
    "sliding_full": ({**SLIDE_FULL, "is_causal": False}, None),
    "sliding_causal_capped": (SLIDE_FULL, 3),
    "full_causal": ({"is_causal": True}, None),
    "full_capped": ({}, 6),
    "conv_sliding": ({**SLIDE_FULL, "conv_kernel_size": 3}, None),  # DFlash2's convolution around every layer
}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return write_tiny_llama_family(tmp_path_factory.mktemp("target"), "qwen3")


def setup_drafter(target: str, tmp_path, keys: dict, cap: int | None, contexts: tuple[int, ...],
                  device: str = "cpu", block: int = BLOCK, max_context: int = 64):  # noqa: ANN001
    """A runner over the tiny target, a 2-layer random drafter of ``keys`` with cap ``cap``, and requests whose
    drafter contexts (``contexts`` tokens each) are written, on ``device`` -> (runner, drafter, draft_kv, rows)."""
    path = write_random_drafter(target, tmp_path, num_layers=2, block_size=block, std=0.1, **keys)
    r = ModelRunner(ModelConfig.load(target, "float32", device=device), max_reqs=8, max_context=max_context,
                    device=device, max_total_tokens=max(512, 2 * sum(contexts) + 64))
    drafter = load_model(ModelConfig.load(path, "float32", device=device), TPGroup(), torch.device(device))
    drafter.configure(cap, None)
    kv = KVCache(drafter.kv_cache_layout(), r.slots.id_space - 1, torch.float32, device)
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in contexts:
        row = r.slots.alloc_row()
        slots = r.slots.alloc(n)
        r.slots.write(row, 0, slots)
        feats = torch.randn(n, len(drafter.target_layer_ids) * 64, generator=g) * 2  # [n, n_layers*H]
        drafter.write_context(feats.to(device), torch.arange(n, device=device), slots, kv)
        rows.append(row)
    return r, drafter, kv, rows


@pytest.mark.parametrize("kind", list(KINDS))
def test_forward_block_drafts_what_the_eager_draft_drafts(target, tmp_path, kind):
    keys, cap = KINDS[kind]
    contexts = (1, 9, 14, 3, 7)
    r, drafter, kv, rows = setup_drafter(target, tmp_path, keys, cap, contexts)
    graphs = DraftGraphs(r, drafter, kv, BLOCK, ReplayByRunning(), (1, 2, 4, 8))
    backend = TorchAttentionBackend()
    for step, pick in enumerate(([0, 1, 2], [3, 4], [4, 2, 0, 1, 3], [1])):  # 4, 2 (padded 4), 8, 1
        idx = torch.tensor([rows[i] for i in pick])
        cached = torch.tensor([contexts[i] for i in pick])
        roots = torch.tensor([(17 * i + 5 * step) % 250 + 1 for i in pick])
        for local in (False, True):
            want, want_shard = draft_forward(r, drafter, kv, backend, BLOCK, idx, cached, roots,
                                             int(cached.max()), local)
            free = r.slots.num_free
            got, shard = draft_forward(r, drafter, kv, backend, BLOCK, idx, cached, roots, int(cached.max()), local,
                                       graphs)
            assert r.slots.num_free == free, "the graphed draft takes no KV slot"
            assert got.shape == want.shape == (len(pick), BLOCK - 1, 256) and shard == want_shard
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graphs.replays == 8 and sorted(graphs.graphs) == [(1, False), (1, True), (2, False), (2, True),
                                                             (4, False), (4, True), (8, False), (8, True)]


def test_a_batch_beyond_the_graphs_drafts_eagerly(target, tmp_path):
    contexts = (2, 5, 4)
    r, drafter, kv, rows = setup_drafter(target, tmp_path, {}, None, contexts)
    graphs = DraftGraphs(r, drafter, kv, BLOCK, ReplayByRunning(), (1, 2))
    idx, cached, roots = torch.tensor(rows), torch.tensor(contexts), torch.tensor([3, 4, 5])
    want, _ = draft_forward(r, drafter, kv, TorchAttentionBackend(), BLOCK, idx, cached, roots, 5)
    got, _ = draft_forward(r, drafter, kv, TorchAttentionBackend(), BLOCK, idx, cached, roots, 5, graphs=graphs)
    assert graphs.replays == 0 and not graphs.graphs and torch.equal(got, want)
    assert graphed_draft(r, (1, 2), drafter, kv, BLOCK) is None  # plain CPU: eager
    assert graphed_draft(r, (), drafter, kv, BLOCK) is None


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory):
    target, drafter = write_simulated_pair(tmp_path_factory.mktemp("sim"), vocab=128, accept_prob=0.8)
    eng = Engine(target, device="cpu", dtype="float32", max_running_requests=8, disable_radix_cache=True,
                 max_total_tokens=4096, speculative_algorithm="ddtree", speculative_draft_model_path=drafter,
                 ddtree_budget=16, speculative_draft_sources="dflash")
    yield eng
    eng.shutdown()


def test_simulated_graphed_draft_is_one_replay_without_syncs(sim_engine):
    r, spec = sim_engine.scheduler.runner, sim_engine.scheduler.spec
    clock = r.model.clock
    graphs = graphed_draft(r, (1, 2, 4, 8), spec.drafter, spec.draft_kv, spec.block_size)
    assert isinstance(graphs, DraftGraphs) and isinstance(graphs.capture, ReplayByRunning)
    rows = [r.slots.alloc_row() for _ in range(3)]
    idx = torch.tensor(rows)
    cached = torch.tensor([5, 9, 2])
    roots = torch.tensor([7, 11, 3])
    args = (r, spec.drafter, spec.draft_kv, spec.draft_backend, spec.block_size)
    with r.device_session():
        idx, cached, roots = (x.to(r.device) for x in (idx, cached, roots))  # device tensors, as the step's
        want, _ = draft_forward(*args, idx, cached, roots, 9)
        clock.reset_counters()
        draft_forward(*args, idx, cached, roots, 9)
        eager = clock.reset_counters()
        draft_forward(*args, idx, cached, roots, 9, graphs=graphs)  # captures (padded size 4), then replays
        clock.reset_counters()
        got, _ = draft_forward(*args, idx, cached, roots, 9, graphs=graphs)
        graphed = clock.reset_counters()
    for row in rows:
        r.slots.free_row(row)
    assert torch.equal(got, want)
    assert not graphed.syncs and graphed.eager_forwards == 0 and graphed.forwards == 1
    # the inputs' stack, copy and padded rows' reset, then one replay for embeddings, drafter and LM head
    assert graphed.launches == 4, graphed.launches
    assert eager.eager_forwards == 1 and eager.launches > 4 * graphed.launches
