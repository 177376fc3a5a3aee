"""GPU check of the graphed draft (speculative/draft_graphs.py, docs/DESIGN.md 4.17): the DFlash drafter's forward
captured in a CUDA graph (``forward_block`` with the Triton block attention, ddtree_serve/kernels/
triton_dflash_attention.py) replays the eager ``draft_forward`` on a tiny random checkpoint, batch after batch
through padded graphs, for sliding + full layers with and without the draft-window cap; the capture holds no host
sync (torch.cuda.graph fails on one). The kernel alone equals the torch reference at the K2.5 drafter's head
shape per TP-8 rank (8 query heads on one KV head, head size 128, block 16) over contexts of thousands of keys,
with and without key splits, and captured in a graph replays with new context lengths."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention import TorchAttentionBackend
from ddtree_serve.kernels.dflash_attention import dflash_block_attention_reference
from ddtree_serve.model_executor.cuda_graph_runner import CudaCapture
from ddtree_serve.speculative.draft_graphs import DraftGraphs, graphed_draft
from ddtree_serve.speculative.tree_forward import draft_forward
from tests.conftest import write_tiny_llama_family
from tests.speculative.test_draft_graphs import BLOCK, SLIDE_FULL, setup_drafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("cap", [None, 6])
def test_draft_graph_replays_the_eager_draft(tmp_path, cap):
    target = write_tiny_llama_family(tmp_path / "target", "qwen3")
    contexts = (1, 9, 40, 3, 300)
    r, drafter, kv, rows = setup_drafter(target, tmp_path / "drafter", {**SLIDE_FULL, "is_causal": False}, cap,
                                         contexts, device="cuda", max_context=512)
    graphs = graphed_draft(r, (1, 2, 4, 8), drafter, kv, BLOCK)
    assert isinstance(graphs, DraftGraphs) and isinstance(graphs.capture, CudaCapture)
    backend = TorchAttentionBackend()
    for step, pick in enumerate(([0, 1, 2], [3, 4], [4, 2, 0, 1, 3], [1], [2, 4, 0])):
        idx = torch.tensor([rows[i] for i in pick], device="cuda")
        cached = torch.tensor([contexts[i] for i in pick], device="cuda")
        roots = torch.tensor([(17 * i + 5 * step) % 250 + 1 for i in pick], device="cuda")
        want, _ = draft_forward(r, drafter, kv, backend, BLOCK, idx, cached, roots, max(contexts), False)
        free = r.slots.num_free
        got, _ = draft_forward(r, drafter, kv, backend, BLOCK, idx, cached, roots, max(contexts), False, graphs)
        assert r.slots.num_free == free
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert graphs.replays == 5 and len(graphs.graphs) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("window", "causal", "cap"), [(None, False, None), (2048, False, None), (512, True, 1000)])
def test_kernel_at_the_drafter_shape(dtype, window, causal, cap):
    from ddtree_serve.kernels.triton_dflash_attention import triton_dflash_block_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    contexts = torch.tensor([1, 700, 3000, 5000], device="cuda")
    bs, blk, hq, hkv, d = 4, 16, 8, 1, 128
    slots = int(contexts.sum()) + 1
    table = torch.zeros(bs + 1, 5200, dtype=torch.int32, device="cuda")
    perm = torch.randperm(slots - 1, device="cuda", generator=g).to(torch.int32) + 1
    off = 0
    for b, n in enumerate(contexts.tolist()):
        table[b + 1, :n] = perm[off:off + n]
        off += n
    kc = torch.randn(slots, hkv, d, device="cuda", generator=g).to(dtype)
    vc = torch.randn(slots, hkv, d, device="cuda", generator=g).to(dtype)
    q = torch.randn(bs * blk, hq, d, device="cuda", generator=g).to(dtype)
    kb = torch.randn(bs * blk, hkv, d, device="cuda", generator=g).to(dtype)
    vb = torch.randn(bs * blk, hkv, d, device="cuda", generator=g).to(dtype)
    idx = torch.arange(1, bs + 1, device="cuda")
    args = (q, kb, vb, kc, vc, table, idx, contexts, window, causal, cap, d**-0.5)
    want = dflash_block_attention_reference(*args)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for splits in (None, 1, 4):  # None: choose_kv_splits (several on an H100 for the long full layer)
        got = triton_dflash_block_attention(*args, num_splits=splits)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    graph = torch.cuda.CUDAGraph()  # capturable: bounds on the device, no host read
    out = torch.empty_like(got)
    triton_dflash_block_attention(*args)  # compiled before the capture
    with torch.cuda.graph(graph):
        out.copy_(triton_dflash_block_attention(*args))
    contexts.copy_(torch.tensor([4000, 2, 700, 1], device="cuda"))  # new lengths, same graph
    graph.replay()
    torch.testing.assert_close(out.float(), dflash_block_attention_reference(*args).float(), atol=tol, rtol=tol)
