"""GPU check of the batch-invariant Triton RMSNorm (ddtree_serve/kernels/triton_rmsnorm.py; issue 60, docs/DESIGN.md
4.18) at the models' hidden sizes (the default model's 576, Kimi's 7168) and a q/k-norm head size: on CUDA a row
normalised alone is bit-identical to the same row inside batches of many sizes (up to a 4096-token prefill
chunk), a switched ``RMSNorm`` module runs the kernel, and the kernel is close to the torch ``RMSNorm``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _case(hidden: int, dtype: torch.dtype, rows: int):
    from ddtree_serve.model_executor.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6, dtype).cuda()
    norm.weight.data = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype).cuda()
    scale = torch.rand(rows, 1, generator=g) * 8 + 0.01
    x = (torch.randn(rows, hidden, generator=g) * scale).to(dtype).cuda()  # [rows, H]
    return norm, x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [128, 576, 7168])
def test_rmsnorm_row_alone_equals_row_in_batches_on_cuda(dtype, hidden):
    from ddtree_serve.kernels.triton_rmsnorm import triton_rmsnorm

    norm, x = _case(hidden, dtype, 4200)
    alone = triton_rmsnorm(x[7:8], norm.weight, norm.eps)  # [1, H]
    for n in (1, 2, 3, 8, 33, 64, 255, 1024, 4096):
        for off in (0, 3, 7):
            if 7 - off < n:
                batch = triton_rmsnorm(x[off:off + n], norm.weight, norm.eps)
                assert torch.equal(batch[7 - off:8 - off], alone), (n, off)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [128, 576, 7168])
def test_switched_rmsnorm_runs_the_kernel_close_to_torch_on_cuda(dtype, hidden):
    from ddtree_serve.kernels.triton_rmsnorm import triton_rmsnorm

    norm, x = _case(hidden, dtype, 300)
    ref = norm(x)  # the torch path (not switched)
    norm.row_invariant = True
    assert norm.uses_triton(x)
    out = norm(x)
    assert torch.equal(out, triton_rmsnorm(x, norm.weight, norm.eps))
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
