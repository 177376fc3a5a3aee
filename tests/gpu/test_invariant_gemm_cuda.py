"""GPU check of the batch-invariant Triton GEMM (ddtree_serve/kernels/triton_invariant_gemm.py): on CUDA a row
computed alone equals the same row inside batches of many sizes and offsets, bit for bit, at the default model's
and Kimi's linear shapes, in bfloat16 and float32; ``invariant_linear`` takes it on CUDA; close to ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 128, 255, 511]
OFFSETS = [0, 1, 5, 37]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k_n", [(576, 1536), (1536, 576), (7168, 2048), (2048, 7168), (1000, 300)])
def test_invariant_gemm_rows_do_not_depend_on_the_batch_on_cuda(dtype, k_n):
    from ddtree_serve.kernels.batch_invariant import invariant_linear
    from ddtree_serve.kernels.triton_invariant_gemm import invariant_gemm

    k, n = k_n
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, k, generator=g).to(dtype).cuda()  # [600, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).cuda()  # [N, K]
    b = torch.randn(n, generator=g).to(dtype).cuda()  # [N]
    rows = list(range(0, 600, 23))
    alone = {i: invariant_gemm(x[i : i + 1], w, b)[0] for i in rows}
    for size in SIZES:
        for off in OFFSETS:
            y = invariant_gemm(x[off : off + size], w, b)  # [size, N]
            for i in rows:
                if off <= i < off + size:
                    assert torch.equal(y[i - off], alone[i]), (size, off, i)
    assert torch.equal(invariant_linear(x[:40], w, b), invariant_gemm(x[:40], w, b))  # the CUDA default path
    want = F.linear(x.float(), w.float(), b.float())
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(invariant_gemm(x, w, b).float(), want, **tol)
