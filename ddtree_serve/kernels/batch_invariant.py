"""Batch-invariant (row-invariant) primitives for ``--enable-deterministic-inference``.

A row's result depends only on that row's inputs and its context, never on how many rows run beside it,
where it sits in the batch, or whether its keys were cached, in the same chunk or tree siblings masked out.
This is what makes speculative decoding lossless in bfloat16 (docs/DESIGN.md 4.18): a token's logits are
computed bit for bit the same as a decode row, a tree node, a prefill-chunk row or after a prefix-cache hit.

Sources: Thinking Machines, "Defeating Nondeterminism in LLM Inference" (He et al., 2025: batch-invariant
RMSNorm, matmul without split-K chosen by the batch, attention with a fixed split size over the KV);
SGLang's ``--enable-deterministic-inference`` and vLLM's batch-invariant mode (the same three kernels).

What each primitive fixes (measured on the CPU this was written on, tests/kernels/test_batch_invariant.py):

- ``row_block_matmul``: the library GEMM may compute a row differently for a different number of rows M
  (float32 GEMM on this CPU does: M = 1..3 and M >= 4 round differently). Rows are padded to a multiple of
  ``ROW_BLOCK`` so the library sees only full row blocks; tests check a row alone and inside batches of
  1..67 rows at every offset of a block give bit-identical results. bfloat16 GEMM (oneDNN, AVX512-BF16) looks
  M-invariant in most shapes here but is not in all (K=1536, N=576: a row differs between M=1 and M=2), so
  no shape is trusted unpadded.
- ``invariant_linear`` on CUDA: cuBLAS picks its kernel (tiles, split-K) by M, so padding rows does not help
  there; the linears run the Triton GEMM of ddtree_serve/kernels/triton_invariant_gemm.py (tiles fixed per
  dtype, K and N, no split-K, K walked in order), checked row-invariant under the interpreter (its CUDA test,
  tests/gpu/test_invariant_gemm_cuda.py, has not run on a GPU yet).
  ``row_block_matmul`` (the attention's per-split GEMMs) runs its batched form (``invariant_matmul``) on CUDA.
- the split attention (``split_partials``, ``split_numerators``, ``sum_splits``, ``normalize_totals``; used by
  attention_invariant.py and mla_invariant.py): the reduction over the keys is fixed by their *logical positions*:
  scores and the P.V partials are computed per split of ``KV_SPLIT`` positions (split ``c`` holds positions
  ``[c*KV_SPLIT, (c+1)*KV_SPLIT)``, in position order, invisible keys contributing an exact 0) by GEMMs of one
  fixed item shape ([ROW_BLOCK, d] x [d, KV_SPLIT] and [ROW_BLOCK, KV_SPLIT] x [KV_SPLIT, dv + 1], the extra
  column of ones giving the softmax denominator from the same product), the softmax takes the exact global
  max, and the splits are combined by a sequential scan (``torch.cumsum``, in position order, trailing empty
  splits adding 0). So neither the number of queries, the padded key width, the tree layout (a node's
  ancestors sit at scattered columns; they are gathered back to their positions) nor the prefix/extend
  boundary changes a query's output.

RMSNorm, rotary, SwiGLU and the sampler's row-wise ops are already row-wise on CPU (tests check it).
No module-level mutable state.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from ddtree_serve.kernels.dispatch import (
    CudaKernelUnavailable,
    cuda_kernels_required,
    kernels_forced_to_torch,
)

ROW_BLOCK = 8  # rows per library GEMM call block (M is always a multiple of it)
KV_SPLIT = 64  # key positions per attention split (fixed, independent of batch, queries and tree)
MIN_VALUE_COLS = 16  # the P.[V, 1] GEMM's columns are zero-padded to at least this many (see split_numerators)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., M, K] -> [..., ceil(M / rows) * rows, K], zero rows appended."""
    pad = -x.shape[-2] % rows
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def triton_gemm_usable(*tensors: torch.Tensor) -> bool:
    """True when ``invariant_linear`` runs the Triton GEMM (ddtree_serve/kernels/triton_invariant_gemm.py) on its
    own: every tensor on CUDA, Triton installed, ``DDTREE_KERNELS`` not ``torch``. Under
    ``DDTREE_REQUIRE_CUDA_KERNELS=1`` a CUDA call without Triton raises ``CudaKernelUnavailable``."""
    if not tensors or not all(t.is_cuda for t in tensors) or kernels_forced_to_torch():
        return False
    if importlib.util.find_spec("triton") is None:
        if cuda_kernels_required():
            raise CudaKernelUnavailable("the batch-invariant GEMM on CUDA needs Triton, which is not installed")
        return False
    return True


def row_block_matmul(
    a: torch.Tensor, b: torch.Tensor, rows: int = ROW_BLOCK, *, use_triton: bool | None = None
) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (b broadcast over a's leading dims) -> [..., M, N], with M padded to a
    multiple of ``rows`` so the library only ever computes full row blocks (its result for a row then
    does not depend on M). ``use_triton`` as in ``invariant_linear``: on CUDA the batch-invariant Triton
    kernel (``invariant_matmul``, at most 3 batch dims) instead."""
    if use_triton is None:
        use_triton = triton_gemm_usable(a, b)
    if use_triton:
        from ddtree_serve.kernels.triton_invariant_gemm import invariant_matmul

        return invariant_matmul(a, b)
    m = a.shape[-2]
    return torch.matmul(_pad_rows(a, rows), b)[..., :m, :]


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, use_triton: bool | None = None
) -> torch.Tensor:
    """``F.linear`` whose rows do not depend on the number of rows: x [..., K], weight [N, K] -> [..., N].

    ``use_triton`` None (the model's calls): on CUDA (``triton_gemm_usable``) the batch-invariant Triton GEMM
    (cuBLAS picks its kernel, split-K included, by M), elsewhere the library's ``F.linear`` with the rows padded to
    whole ``ROW_BLOCK``s. True forces the Triton GEMM (tests: CPU tensors under ``TRITON_INTERPRET=1``), False
    the padded library call."""
    if use_triton is None:
        use_triton = triton_gemm_usable(x, weight, *(() if bias is None else (bias,)))
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    if use_triton:
        from ddtree_serve.kernels.triton_invariant_gemm import invariant_gemm

        y = invariant_gemm(flat, weight, bias)  # [M, N]
    else:
        y = F.linear(_pad_rows(flat, ROW_BLOCK), weight, bias)[: flat.shape[0]]  # [M, N] (the library's own linear:
        # a matmul against weight.t() would repack the weight every call)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def split_partials(
    q: torch.Tensor,  # [B, H, M, d] float32 (scaled)
    k: torch.Tensor,  # [B, H, S, KV_SPLIT, d] float32, S splits
    v: torch.Tensor,  # [B, H, S, KV_SPLIT, dv] float32
    visible: torch.Tensor,  # [B, 1 or H, S, M, KV_SPLIT] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and the max of each query's visible scores: -> (scores [B, H, S, M, KV_SPLIT] with -inf where
    invisible, max [B, H, M] over every split, -inf for a query that sees nothing). Each split's scores
    come from one GEMM item shape ([ROW_BLOCK, d] x [d, KV_SPLIT])."""
    s = row_block_matmul(q[:, :, None], k.transpose(-1, -2))  # [B, H, S, M, C]
    s = s.masked_fill(~visible, float("-inf"))
    return s, s.amax(dim=(2, 4))


def split_numerators(
    s: torch.Tensor,  # [B, H, S, M, KV_SPLIT] scores, -inf where invisible
    m: torch.Tensor,  # [B, H, M] the query's max over all its visible keys (finite or -inf)
    v: torch.Tensor,  # [B, H, S, KV_SPLIT, dv] float32, zero where the slot holds no key
) -> torch.Tensor:  # [B, H, S, M, dv + 1]
    """Per split: sum_j exp(s_j - m) [v_j, 1] (an exact 0 for invisible keys), by one GEMM item shape
    ([ROW_BLOCK, KV_SPLIT] x [KV_SPLIT, max(dv + 1, MIN_VALUE_COLS)]). The columns are zero-padded to
    ``MIN_VALUE_COLS``: with fewer (measured: 5..7 and 9..11 at K = 64, float32 MKL on this CPU) the library
    computes a row differently by its position mod 4 in the matrix, which moves with the query count (rows
    are (head, query) pairs). Model shapes (dv >= 16) are unpadded."""
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m[:, :, None, :, None])  # [B, H, S, M, C], 0 where s = -inf
    ones = torch.ones_like(v[..., :1])
    vals = torch.cat([v, ones], dim=-1)  # [B, H, S, C, dv + 1]
    cols = vals.shape[-1]
    if cols < MIN_VALUE_COLS:
        vals = F.pad(vals, (0, MIN_VALUE_COLS - cols))
    return row_block_matmul(p, vals)[..., :cols]  # [B, H, S, M, dv + 1]


def sum_splits(parts: torch.Tensor) -> torch.Tensor:
    """parts [..., S, M, dv + 1] -> [..., M, dv + 1]: the splits summed by a sequential scan in split (position)
    order, so empty trailing splits add an exact 0 and the sum is the same for any split count."""
    return torch.cumsum(parts, dim=-3)[..., -1, :, :]


def normalize_totals(total: torch.Tensor) -> torch.Tensor:
    """total [..., dv + 1] (numerator, softmax denominator last) -> [..., dv]: num / den elementwise (a query
    that saw nothing, den = 0, gets 0)."""
    num, den = total[..., :-1], total[..., -1:]
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))

