"""The batch-invariant Triton GEMM (ddtree_serve/kernels/triton_invariant_gemm.py) under the interpreter: a row
computed alone equals the same row inside batches of many sizes and at many offsets (so at every tile-row
position), bit for bit, in float32 and bfloat16; and the result is close to ``F.linear``. The check is shown to
fail for a variant whose reduction over K is chosen by M (a split-K-by-M stand-in)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ddtree_serve.kernels.batch_invariant import invariant_linear, row_block_matmul  # noqa: E402
from ddtree_serve.kernels.triton_invariant_gemm import (  # noqa: E402
    GemmTiles,
    gemm_tiles,
    invariant_gemm,
    invariant_matmul,
)

DTYPES = [torch.float32, torch.bfloat16]
# (K, N): small; the default model's (576 -> 1536, 1536 -> 576) and Kimi's (7168 -> 2048) scaled down, K not a
# multiple of BLOCK_K and N not a multiple of BLOCK_N among them
SHAPES = [(24, 20), (72, 200), (200, 72), (300, 130)]
# the row-invariance check's shapes: (300, 130) is slow-only there (~25 s of the interpreter for both dtypes); it
# takes the same full-width tiles as (72, 200) in each dtype (gemm_tiles: 32 x 64 x 32 float32, 64 x 128 x 64
# bfloat16), with several K steps, a partial last K step and a partial last N tile, all of which (72, 200) and
# (200, 72) check in the default suite; test_close_to_f_linear still runs it there
INVARIANCE_SHAPES = [*SHAPES[:3], pytest.param(SHAPES[3], marks=pytest.mark.slow)]
SIZES = [1, 2, 3, 5, 8, 13, 31, 33, 64, 65, 97]
OFFSETS = [0, 1, 7, 30]


def _operands(k: int, n: int, dtype: torch.dtype, rows: int = 140, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)  # [rows, K]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)  # [N, K]
    b = torch.randn(n, generator=g).to(dtype)  # [N]
    return x, w, b


def _violations(gemm, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> list[tuple[int, int]]:  # noqa: ANN001
    """(size, offset) of every batch x[off : off + size] in which some row differs from the row computed alone."""
    alone = torch.cat([gemm(x[i : i + 1], w, b) for i in range(x.shape[0])])  # [rows, N], M = 1 each
    bad = []
    for size in SIZES:
        for off in OFFSETS:
            if off + size <= x.shape[0] and not torch.equal(gemm(x[off : off + size], w, b), alone[off : off + size]):
                bad.append((size, off))
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_n", INVARIANCE_SHAPES)
def test_row_alone_equals_row_in_batches(dtype, k_n):
    """Every row of batches of 1..97 rows at offsets 0/1/7/30 (every tile-row position) equals that row alone."""
    x, w, b = _operands(*k_n, dtype)
    assert _violations(invariant_gemm, x, w, b) == []
    assert _violations(invariant_gemm, x, w, None) == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_n", SHAPES)
def test_close_to_f_linear(dtype, k_n):
    x, w, b = _operands(*k_n, dtype, rows=37)
    for bias in (b, None):
        got = invariant_gemm(x, w, bias)
        assert got.dtype == dtype and got.shape == (37, k_n[1])
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got.float(), want, **tol)


def test_check_catches_a_reduction_chosen_by_m():
    """The invariance check is not vacuous: a variant whose K step depends on M (16 for up to 4 rows, else the
    fixed one: a split of the reduction chosen by the batch, as a library's split-K is) is caught."""
    x, w, b = _operands(200, 72, torch.float32, rows=40)
    fixed = gemm_tiles(torch.float32, 200, 72)

    def by_m(xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None) -> torch.Tensor:
        bk = 16 if xs.shape[0] <= 4 else fixed.block_k
        return invariant_gemm(xs, ws, bs, tiles=GemmTiles(fixed.block_m, fixed.block_n, bk, 4, 2))

    assert _violations(by_m, x, w, b)


def test_tiles_do_not_depend_on_m_and_bad_inputs_raise():
    assert gemm_tiles(torch.bfloat16, 7168, 2048) == GemmTiles(64, 128, 64, 4, 3)
    assert gemm_tiles(torch.float32, 24, 20) == GemmTiles(32, 32, 32, 4, 2)
    with pytest.raises(ValueError):
        gemm_tiles(torch.int8, 8, 8)
    with pytest.raises(ValueError):
        invariant_gemm(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16))
    assert invariant_gemm(torch.zeros(0, 8), torch.zeros(4, 8)).shape == (0, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_linear_forced_to_triton_is_row_invariant(dtype):
    """``invariant_linear(..., use_triton=True)`` (the CUDA path, forced on CPU under the interpreter): leading
    dims flattened, rows alone == rows in batches; the default on CPU tensors stays the padded library path."""
    x, w, b = _operands(72, 200, dtype, rows=70)

    def lin(xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None) -> torch.Tensor:
        return invariant_linear(xs, ws, bs, use_triton=True)

    assert _violations(lin, x, w, b) == []
    y3 = invariant_linear(x[:60].view(3, 20, 72), w, b, use_triton=True)  # [3, 20, N]
    assert torch.equal(y3.reshape(60, 200), invariant_gemm(x[:60], w, b))
    assert torch.equal(invariant_linear(x, w, b), invariant_linear(x, w, b, use_triton=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_matmul_rows_are_invariant_and_close(dtype):
    """``invariant_matmul`` (``row_block_matmul(..., use_triton=True)``, the attention's per-split GEMMs) at the
    attention's item shapes: scores q [B, H, 1, M, d] @ k^T [B, H, S, d, 64] (b K-contiguous, a broadcast over S)
    and partials p [B, H, S, M, 64] @ [v, 1] [B, H, S, 64, dv + 1] (b N-contiguous): each query row alone equals
    the row among 1..21 others at offsets 0/5, and both match torch.matmul."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 1, 26, 32, generator=g).to(dtype)  # [B, H, 1, M, d]
    k = torch.randn(2, 2, 3, 64, 32, generator=g).to(dtype)  # [B, H, S, C, d]
    p = torch.rand(2, 2, 3, 26, 64, generator=g).to(dtype)  # [B, H, S, M, C]
    v1 = torch.randn(2, 2, 3, 64, 17, generator=g).to(dtype)  # [B, H, S, C, dv + 1]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    for a, b in ((q, k.transpose(-1, -2)), (p, v1)):
        full = row_block_matmul(a, b, use_triton=True)  # [B, H, S, M, N]
        torch.testing.assert_close(full.float(), a.float() @ b.float(), **tol)
        alone = torch.cat([invariant_matmul(a[..., i : i + 1, :], b) for i in range(a.shape[-2])], dim=-2)
        assert torch.equal(alone, full)
        for size in (1, 2, 7, 8, 9, 21):
            for off in (0, 5):
                got = invariant_matmul(a[..., off : off + size, :], b)
                assert torch.equal(got, alone[..., off : off + size, :]), (size, off)
    with pytest.raises(ValueError):
        invariant_matmul(torch.zeros(1, 1, 1, 1, 2, 8), torch.zeros(8, 3))
    assert torch.equal(row_block_matmul(q, k.transpose(-1, -2)), row_block_matmul(q, k.transpose(-1, -2), use_triton=False))
