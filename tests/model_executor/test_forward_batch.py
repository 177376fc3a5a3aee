"""The dense ``[bs, Q, K]`` attention mask is built only for backends that read it (forward_batch.py).

Per backend: a Llama (torch attention; flashinfer reads it too) and the tiny DeepSeek-V3 with the torch MLA
reference builds it; the tiny DeepSeek-V3 with the Triton MLA kernels (Triton's interpreter on CPU) gets a
``[bs, Q, 1]`` placeholder that holds no memory, and its extend, decode and tree-verify forwards over the
placeholder equal the same forwards over a dense mask. The torch reference refuses a placeholder.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.forward_batch import ForwardMode, build_forward_batch
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.model_runner import ModelRunner
from tests.model_executor.tiny_deepseek import write_tiny_deepseek


def _runner(path: str, **backends) -> ModelRunner:
    cfg = ModelConfig.load(path, "float32", "cpu", **backends)
    return ModelRunner(cfg, max_total_tokens=256, max_reqs=3, max_context=128)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("kimi-mask"), int4=False, kimi=True, seed=2).path


def _tree() -> torch.Tensor:
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)  # [1, Q, Q] ancestors and self
    for i in range(4):
        j = i
        while j >= 0:
            mask[0, i, j], j = True, parents[j]
    return mask


def _forwards(r: ModelRunner, dense: bool) -> list[torch.Tensor]:
    """Extend 5 tokens, decode one, verify a 4-node tree after them (one request row)."""
    outs, table = [], r.slots.table

    def run(mode, row, ids, prefix, tree_mask=None):  # noqa: ANN001, ANN202
        n = len(ids)
        slots = r.slots.place(torch.tensor([row]), torch.tensor([prefix]), torch.tensor([n]))  # [n]
        depth = [0, 1, 1, 2] if mode == ForwardMode.TARGET_VERIFY else list(range(n))
        fb = build_forward_batch(mode, torch.tensor(ids), torch.tensor([prefix + d for d in depth]), slots, table,
                                 torch.tensor([row]), torch.tensor([prefix]), torch.tensor([n]), tree_mask=tree_mask,
                                 dense_mask=dense)
        assert fb.has_dense_mask == dense and fb.max_q == n
        if not dense:  # an expanded scalar: no [bs, Q, K] memory
            assert fb.attn_mask.shape == (1, n, 1) and fb.attn_mask.untyped_storage().nbytes() == 1
        outs.append(r.logits(r.forward(fb).hidden))

    run(ForwardMode.EXTEND, 0, [3, 9, 27, 81, 5], 0)
    run(ForwardMode.DECODE, 0, [63], 5)
    run(ForwardMode.TARGET_VERIFY, 0, [11, 12, 13, 14], 6, _tree())
    return outs


def test_masks_per_backend(kimi, tiny_llama_factory) -> None:
    pytest.importorskip("triton")
    assert _runner(tiny_llama_factory("llama")).dense_mask  # torch / flashinfer attention read it
    ref = _runner(kimi, attention_backend="torch", moe_backend="torch")
    assert ref.dense_mask
    tri = _runner(kimi, attention_backend="triton", moe_backend="torch")
    assert not tri.dense_mask
    fb = tri.prepare_prefill([2], [0], [6], [1, 2, 3, 4, 5, 6])  # what the scheduler's prefill builds
    assert not fb.has_dense_mask and fb.attn_mask.shape == (1, 6, 1)
    assert ref.prepare_prefill([2], [0], [6], [1, 2, 3, 4, 5, 6]).attn_mask.shape == (1, 6, 6)


@pytest.mark.slow
def test_placeholder_forwards_equal_dense(kimi) -> None:
    """Triton MLA (interpreted: slow) over the placeholder == over the dense mask, bit for bit."""
    pytest.importorskip("triton")
    tri = _runner(kimi, attention_backend="triton", moe_backend="torch")
    dense = _forwards(tri, True)
    tri2 = _runner(kimi, attention_backend="triton", moe_backend="torch")
    for a, b in zip(dense, _forwards(tri2, False), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="dense"):
        _forwards(_runner(kimi, attention_backend="torch", moe_backend="torch"), False)
