"""CudaGraphRunner's padding contract on CPU: the padded static decode / verify batches (``capture=False``:
the same static buffers run eagerly, Triton kernels in the interpreter) give the plain forward's hidden
states and captured layers exactly (same kernels per row; padded requests only touch slot 0). Graph
capture itself needs CUDA: tests/gpu/test_cuda_graph_cuda.py checks graph == eager there."""

from __future__ import annotations

import pytest
import torch

from model_executor.cuda_graph_runner import CudaGraphRunner, check_graphable, graph_batch_sizes
from model_executor.forward_batch import ForwardMode, build_forward_batch
from model_executor.model_config import ModelConfig
from model_executor.model_runner import ModelRunner
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


def test_padded_static_batches_equal_the_plain_forward(tmp_path):
    path = write_tiny_deepseek(tmp_path, int4=True, kimi=True, seed=3, num_hidden_layers=2).path
    cfg = ModelConfig.load(path, "float32", "cpu", "packed", attention_backend="triton", moe_backend="triton")
    r = ModelRunner(cfg, max_total_tokens=256, max_reqs=4, max_context=64)
    graphs = CudaGraphRunner(r.model, r.kv, r.backend, (1, 4), 64, "cpu", capture=False)
    lens = [9, 4, 6]
    for b, n in enumerate(lens):  # prefill three requests
        slots = r.slots.place(torch.tensor([b]), torch.tensor([0]), torch.tensor([n]))
        r.forward(
            build_forward_batch(
                ForwardMode.EXTEND,
                torch.tensor(_ids(n, b)),
                torch.arange(n),
                slots,
                r.slots.table,
                torch.tensor([b]),
                torch.tensor([0]),
                torch.tensor([n]),
            )
        )
    idx, pre = torch.arange(3), torch.tensor(lens)
    for mode, q in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 4)):
        slots = r.slots.place_block(idx, pre, q)  # [3, q]
        tree = None
        if mode == ForwardMode.TARGET_VERIFY:  # root -> {1, 2}, 2 -> 3
            tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
            tree = tree.expand(3, q, q)
        depth = torch.tensor([0, 1, 1, 2][:q])
        fb = build_forward_batch(
            mode,
            torch.tensor(_ids(3 * q, 40 + q)),
            (pre[:, None] + depth).reshape(-1),
            slots.reshape(-1),
            r.slots.table,
            idx,
            pre,
            torch.full((3,), q),
            tree_mask=tree,
            capture_layer_ids=(1, 0),
        )
        assert graphs.can_run(fb)
        with torch.inference_mode():
            want = r.forward(fb)
            got = graphs.forward(fb)  # 3 requests padded to 4
        assert got.hidden.shape == want.hidden.shape == (3 * q, cfg.hidden_size)
        # float32 rounding only: the padded forward multiplies 4q rows, the plain one 3q, and a CPU BLAS may
        # block (and so sum) by the row count (an AMD EPYC gave 2.2e-6 abs / 4e-5 rel); a padding row that
        # leaked into a real one would differ by orders of magnitude more
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.captured, want.captured, atol=1e-5, rtol=1e-4)
    extend = build_forward_batch(
        ForwardMode.EXTEND,
        torch.tensor([1, 2]),
        torch.tensor([20, 21]),
        torch.tensor([0, 0]),
        r.slots.table,
        torch.tensor([0]),
        torch.tensor([20]),
        torch.tensor([2]),
    )
    assert not graphs.can_run(extend)  # prefill stays eager
