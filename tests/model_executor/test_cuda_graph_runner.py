"""CudaGraphRunner on CPU, through a stand-in for CUDA graph capture (tests/model_executor/
graph_capture_standin.py: warm-ups run, capture records, replay runs the static batch; Triton kernels in the
interpreter): the padded static decode / verify batches give the plain forward's hidden states, captured
layers and KV (each path in a fresh copy of the pool), padded requests touch slot 0 only, and capturing a
new batch size after use leaves live KV alone. Graph capture itself needs CUDA:
tests/gpu/test_cuda_graph_cuda.py checks graph == eager there."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.cuda_graph_runner import CudaGraphRunner, check_graphable, graph_batch_sizes
from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner
from tests.model_executor.graph_capture_standin import RecordingCapture
from tests.model_executor.test_deepseek_v3 import _ids
from tests.model_executor.tiny_deepseek import write_tiny_deepseek

pytest.importorskip("triton")


def test_batch_sizes_and_graphable_models(tmp_path):
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(12) == (1, 2, 4, 8, 12)
    assert graph_batch_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    path = write_tiny_deepseek(tmp_path, int4=True, kimi=True).path
    check_graphable(
        ModelConfig.load(path, "float32", "cpu", attention_backend="triton", moe_backend="triton")
    )
    for attn, moe in (("torch", "triton"), ("triton", "torch")):
        with pytest.raises(ValueError, match="CUDA graphs are wired"):
            check_graphable(ModelConfig.load(path, "float32", "cpu", attention_backend=attn, moe_backend=moe))
    with pytest.raises(ValueError, match="need a CUDA device"):
        CudaGraphRunner(None, None, None, (1,), 64, "cpu")
    cfg = ModelConfig.load(path, "float32", "cpu", attention_backend="torch")
    with pytest.raises(
        ValueError, match="CUDA graphs are wired"
    ):  # --cuda-graph-max-bs is checked at startup
        ModelRunner(
            cfg, max_total_tokens=64, max_reqs=2, max_context=32, cuda_graph_max_bs=2
        )


def _prefilled_runner(tmp_path, lens: list[int], dev: str = "cpu") -> tuple[ModelRunner, ModelConfig]:
    """Tiny Kimi (INT4, Triton backends; on CPU under the interpreter) with one prefilled request per
    ``lens``."""
    path = write_tiny_deepseek(tmp_path, int4=True, kimi=True, seed=3, num_hidden_layers=2).path
    cfg = ModelConfig.load(path, "float32", dev, "packed", attention_backend="triton", moe_backend="triton")
    r = ModelRunner(cfg, max_total_tokens=256, max_reqs=4, max_context=64, device=dev)
    for b, n in enumerate(lens):
        slots = r.slots.place(torch.tensor([b]), torch.tensor([0]), torch.tensor([n]))
        r.forward(
            build_forward_batch(
                ForwardMode.EXTEND,
                torch.tensor(_ids(n, b), device=dev),
                torch.arange(n, device=dev),
                slots,
                r.slots.table,
                torch.tensor([b], device=dev),
                torch.tensor([0]),
                torch.tensor([n]),
            )
        )
    return r, cfg


def _step(r: ModelRunner, mode: ForwardMode, q: int, rows: list[int], lens: list[int], seed: int):
    """A decode (q 1) or verify (q 4: root -> {1, 2}, 2 -> 3) step of requests ``rows`` on fresh slots."""
    dev = r.device
    idx, pre = torch.tensor(rows, device=dev), torch.tensor(lens, device=dev)
    bs = len(rows)
    slots = r.slots.place_block(idx, pre, q)  # [bs, q]
    tree = None
    if mode == ForwardMode.TARGET_VERIFY:
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        tree = tree.to(dev).expand(bs, q, q)
    depth = torch.tensor([0, 1, 1, 2][:q], device=dev)
    return build_forward_batch(
        mode,
        torch.tensor(_ids(bs * q, seed), device=dev),
        (pre[:, None] + depth).reshape(-1),
        slots.reshape(-1),
        r.slots.table,
        idx,
        pre,
        torch.full((bs,), q),
        tree_mask=tree,
        capture_layer_ids=(1, 0),
    )


def _pool(r: ModelRunner) -> list[torch.Tensor]:
    return [k.clone() for k in r.kv.k]  # MLA: one latent buffer per layer [slots + 1, 1, L + R]


def _restore(r: ModelRunner, pool: list[torch.Tensor]) -> None:
    for k, saved in zip(r.kv.k, pool, strict=True):
        k.copy_(saved)


def _outside(n: int, slots: torch.Tensor) -> torch.Tensor:
    """[n] bool: every slot but ``slots`` and slot 0 (the padding slot)."""
    keep = torch.ones(n, dtype=torch.bool, device=slots.device)
    keep[slots] = False
    keep[0] = False
    return keep


MODES = ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 4))


def test_graph_path_writes_the_eager_kv_into_a_fresh_pool(tmp_path):
    check_fresh_pool_kv(tmp_path, "cpu", RecordingCapture())


def test_capture_after_use_leaves_live_kv_alone(tmp_path):
    check_capture_after_use(tmp_path, "cpu", RecordingCapture())


def check_fresh_pool_kv(tmp_path, dev: str, capture) -> None:
    """The padded static batches (through ``capture``: warm-ups, capture, replay; the stand-in on CPU, CUDA
    graphs on a GPU) give the plain
    forward's hidden states and captured layers, and write the KV the eager forward writes, checked in a
    fresh copy of the pool per path: the step's slots hold nothing before either path (issue 37: run after
    the eager forward in the same pool, a graph runner that wrote every token's KV to slot 0 passed)."""
    lens = [9, 4, 6]
    r, cfg = _prefilled_runner(tmp_path, lens, dev)
    graphs = CudaGraphRunner(r.model, r.kv, r.backend, (1, 4), 64, dev, capture=capture)
    for mode, q in MODES:
        fb = _step(r, mode, q, [0, 1, 2], lens, 40 + q)
        assert graphs.can_run(fb)
        base = _pool(r)
        with torch.inference_mode():
            want = r.forward(fb)
            eager = _pool(r)
            _restore(r, base)
            got = graphs.forward(fb)  # 3 requests padded to 4
            graph = _pool(r)
            _restore(r, base)
        assert got.hidden.shape == want.hidden.shape == (3 * q, cfg.hidden_size)
        # float32 rounding only: the padded forward multiplies 4q rows, the plain one 3q, and a CPU BLAS may
        # block (and so sum) by the row count (an AMD EPYC gave 2.2e-6 abs / 4e-5 rel); a padding row that
        # leaked into a real one would differ by orders of magnitude more
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.captured, want.captured, atol=1e-5, rtol=1e-4)
        own = fb.out_cache_loc
        for layer, (b, e, g) in enumerate(zip(base, eager, graph, strict=True)):
            assert not torch.equal(e[own], b[own]), layer  # the eager forward wrote the step's slots
            torch.testing.assert_close(g[own], e[own], atol=1e-5, rtol=1e-4)  # ... and so did the graph path
            keep = _outside(b.shape[0], own)
            assert torch.equal(g[keep], b[keep]), layer  # and nothing else but the padding slot
    extend = build_forward_batch(
        ForwardMode.EXTEND,
        torch.tensor([1, 2], device=dev),
        torch.tensor([20, 21], device=dev),
        torch.tensor([0, 0], device=dev),
        r.slots.table,
        torch.tensor([0], device=dev),
        torch.tensor([20]),
        torch.tensor([2]),
    )
    assert not graphs.can_run(extend)  # prefill stays eager


def check_capture_after_use(tmp_path, dev: str, capture) -> None:
    """issue 33 item 2: a new padded batch size first captured for a query length used before. Its warm-up
    forwards really run and write KV at the static ``out_cache_loc``; before the fix they ran on the previous
    step's buffers and wrote into the previous step's slots, which may hold another request's KV by then.
    Here those slots hold live KV (random values) when the second size is captured: the pool must stay as it
    was outside the step's own slots and slot 0."""
    lens = [9, 4, 6]
    r, _ = _prefilled_runner(tmp_path, lens, dev)
    graphs = CudaGraphRunner(r.model, r.kv, r.backend, (1, 4), 64, dev, capture=capture)
    events = getattr(capture, "events", None)  # the stand-in's record (CUDA capture keeps none)
    g = torch.Generator().manual_seed(5)
    for mode, q in MODES:
        with torch.inference_mode():
            first = _step(r, mode, q, [0, 1, 2], lens, 60 + q)
            held = graphs.forward(first)  # captures padded size 4 for this q
            kept = held.hidden.clone()
            for k in r.kv.k:  # the first step's slots now belong to other requests
                k[first.out_cache_loc] = torch.randn(k[first.out_cache_loc].shape, generator=g).to(k.device)
            live = _pool(r)
            second = _step(r, mode, q, [2], lens[2:], 70 + q)
            if events is not None:
                events.clear()
            got = graphs.forward(second)  # captures padded size 1 for the same q
            assert events is None or events == ["warm_up", "warm_up", "capture", "replay"]
            after = _pool(r)
            _restore(r, live)
            want = r.forward(second)
        # both sizes write one output buffer per q; what forward returned is a copy the next replay leaves alone
        assert torch.equal(held.hidden, kept)
        for layer, (before, now) in enumerate(zip(live, after, strict=True)):
            keep = _outside(before.shape[0], second.out_cache_loc)
            assert torch.equal(now[keep], before[keep]), (mode, layer)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-4)
    assert sorted(q for q, _ in graphs.outputs) == [1, 4]  # per q (decode, verify), not per graph
