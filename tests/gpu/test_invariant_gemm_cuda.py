"""GPU check of the batch-invariant Triton GEMM (ddtree_serve/kernels/triton_invariant_gemm.py): on CUDA a row
computed alone equals the same row inside batches of many sizes and offsets, bit for bit, at the default model's
and Kimi's linear shapes, in bfloat16 and float32 (K = 1002: row slices at 4/8-byte aligned addresses, so
kernels specialised for other alignments run too); ``invariant_linear`` takes it on CUDA; close to ``F.linear``;
the batched form (``row_block_matmul`` on CUDA) at the attention's item shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SIZES = [1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 128, 255, 511]
OFFSETS = [0, 1, 5, 37]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k_n", [(576, 1536), (1536, 576), (7168, 2048), (2048, 7168), (1002, 300)])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_block_matmul_rows_do_not_depend_on_the_query_count_on_cuda(dtype):
    """The attention's P.V item ([B, H, S, M, 64] @ [B, H, S, 64, dv + 1]) on CUDA through ``row_block_matmul``:
    each query row alone equals the row among 1..300 others (batch strides M * K change with M)."""
    from ddtree_serve.kernels.batch_invariant import row_block_matmul

    g = torch.Generator().manual_seed(1)
    p = torch.rand(2, 4, 3, 300, 64, generator=g).to(dtype).cuda()  # [B, H, S, M, C]
    v1 = torch.randn(2, 4, 3, 64, 129, generator=g).to(dtype).cuda()  # [B, H, S, C, dv + 1]
    full = row_block_matmul(p, v1)  # [B, H, S, 300, 129]
    for i in (0, 7, 100, 299):
        assert torch.equal(row_block_matmul(p[..., i : i + 1, :], v1)[..., 0, :], full[..., i, :]), i
    for size in (1, 2, 9, 64, 65, 200):
        for off in (0, 3, 99):
            assert torch.equal(row_block_matmul(p[..., off : off + size, :], v1), full[..., off : off + size, :])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=5e-2)
    torch.testing.assert_close(full.float(), p.float() @ v1.float(), **tol)
