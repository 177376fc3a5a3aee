"""The batch-invariant Triton RMSNorm (ddtree_serve/kernels/triton_rmsnorm.py; issue 60, docs/DESIGN.md 4.18)
under ``TRITON_INTERPRET=1``: a row normalised alone is bit-identical (``torch.equal``) to the same row inside
batches of many sizes and offsets, bfloat16 and float32, hidden sizes that are and are not multiples of the
chunk ``BLOCK``; the kernel is close to the torch ``RMSNorm`` (float32 1e-5, bfloat16 2e-2, the tolerances of
tests/kernels/test_triton_mla.py); and ``use_invariant_linears`` switches the model's norms, which keep the
torch path on CPU (unchanged bits) and run the kernel when forced."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.model_executor.layers.linear import use_invariant_linears
from ddtree_serve.model_executor.layers.norm import RMSNorm

pytest.importorskip("triton")

from ddtree_serve.kernels.triton_rmsnorm import MAX_BLOCK, rmsnorm_block, triton_rmsnorm  # noqa: E402

DTYPES = [torch.bfloat16, torch.float32]
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
# (hidden, block): one chunk exactly, one masked chunk, several chunks with a ragged tail, several exact chunks
SHAPES = [(64, None), (100, None), (200, 64), (256, 64), (1500, None)]


def _norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-6, dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)
    return norm


def _rows(n: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, generator=g) * 8 + 0.01  # rows of very different magnitudes
    return (torch.randn(n, hidden, generator=g) * scale).to(dtype)  # [n, H]


def test_block_depends_on_hidden_size_only():
    assert [rmsnorm_block(h) for h in (64, 100, 576, 1024, 1500, 7168)] == [64, 128, 1024, 1024, 1024, 1024]
    assert MAX_BLOCK == 1024


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden", "block"), SHAPES)
def test_row_alone_equals_row_in_batches(dtype, hidden, block):
    """Row 7 alone vs inside batches of 1..97 rows at offsets 0, 3, 7: bit-identical."""
    norm = _norm(hidden, dtype)
    x = _rows(110, hidden, dtype)
    alone = triton_rmsnorm(x[7:8], norm.weight, norm.eps, block=block)  # [1, H]
    for n in (1, 2, 5, 16, 33, 97):
        for off in (0, 3, 7):
            if off > 7 or 7 - off >= n:
                continue
            batch = triton_rmsnorm(x[off:off + n], norm.weight, norm.eps, block=block)
            assert torch.equal(batch[7 - off:8 - off], alone), (n, off)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden", "block"), SHAPES)
def test_close_to_torch_rmsnorm(dtype, hidden, block):
    norm = _norm(hidden, dtype, seed=2)
    x = _rows(13, hidden, dtype, seed=3)
    out = triton_rmsnorm(x, norm.weight, norm.eps, block=block)
    ref = norm(x)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_leading_dims_and_strided_input():
    """``[T, heads, head_dim]`` views (q/k norms over a slice of a fused projection) keep their shape."""
    norm = _norm(16, torch.float32)
    qkv = _rows(6, 5 * 16, torch.float32).view(6, 5, 16)
    q = qkv[:, 1:4]  # [6, 3, 16], non-contiguous
    out = triton_rmsnorm(q, norm.weight, norm.eps)
    assert out.shape == (6, 3, 16)
    torch.testing.assert_close(out, norm(q), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2, 1], triton_rmsnorm(q[2, 1:2], norm.weight, norm.eps)[0])


def test_rejects_bad_block_and_weight():
    norm = _norm(64, torch.float32)
    x = _rows(2, 64, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        triton_rmsnorm(x, norm.weight, norm.eps, block=48)
    with pytest.raises(ValueError, match="hidden size"):
        triton_rmsnorm(x, norm.weight[:32], norm.eps)


def test_use_invariant_linears_switches_model_norms(tiny_llama_factory):
    """Every ``RMSNorm`` of a tiny Qwen3 (layer norms, final norm, q/k norms) is switched; on CPU a switched
    norm keeps the torch path (same bits as before), and ``force_triton`` runs the kernel."""
    from ddtree_serve.model_executor.model_config import ModelConfig
    from ddtree_serve.model_executor.model_registry import get_model_class

    path = tiny_llama_factory("qwen3")
    cfg = ModelConfig.load(path, "bfloat16", "cpu")
    model = get_model_class(cfg.architecture)(cfg)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 3 * 4 + 1 and not any(m.row_invariant for m in norms)
    switched = use_invariant_linears(model)
    assert all(m.row_invariant for m in norms) and switched >= len(norms)

    norm = norms[0]
    norm.weight.data = _norm(norm.weight.shape[0], torch.bfloat16).weight.data
    x = _rows(9, norm.weight.shape[0], torch.bfloat16)
    plain = RMSNorm(norm.weight.shape[0], norm.eps, torch.bfloat16)
    plain.weight.data = norm.weight.data
    assert not norm.uses_triton(x)
    assert torch.equal(norm(x), plain(x))
    norm.force_triton = True
    assert norm.uses_triton(x)
    assert torch.equal(norm(x), triton_rmsnorm(x, norm.weight, norm.eps))
