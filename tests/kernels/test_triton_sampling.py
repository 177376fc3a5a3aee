"""The Triton sampling kernel (ddtree_serve/kernels/triton_sampling.py) against the torch reference of
``draw_tokens`` (softmax(l / T), top-k, top-p, min-p, inverse CDF), under Triton's interpreter on CPU."""

from __future__ import annotations

import torch

from ddtree_serve.kernels.triton_sampling import triton_draw_sampled
from ddtree_serve.model_executor.sampler import BatchSamplingInfo, draw_tokens
from ddtree_serve.model_executor.sampling_params import SamplingParams


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=(0.4, 0.9, 1.3)[i % 3], top_k=(0, 3, 17, 60)[i % 4],
                          top_p=(1.0, 0.9, 0.5)[(i // 2) % 3], min_p=(0.0, 0.0, 0.1)[(i // 3) % 3])


def test_kernel_equals_reference_on_random_rows() -> None:
    """48 rows over a vocabulary of 70 (blocks of 32: a partial last block), every filter combination, with
    ties in some rows (repeated logits); the kernel's tokens equal the reference's."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 48, 70
    logits = torch.randn(n, vocab, generator=gen) * 2
    logits[::5, 10:20] = logits[::5, 10:11]  # ties at the top-k / top-p boundary
    params = [_params(i) for i in range(n)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    want = draw_tokens(logits, info, u)
    got = triton_draw_sampled(logits, info.temperature, info.top_k, info.top_p, info.min_p, u, block=32)
    assert torch.equal(got, want), (got - want).nonzero()[:, 0].tolist()


def test_kernel_edges() -> None:
    """u = 0 picks the first kept token; u just below 1 the last kept one; top-k 1 is the argmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0]] * 3)
    t = torch.ones(3)
    got = triton_draw_sampled(logits, t, torch.tensor([5, 5, 1]), torch.ones(3), torch.zeros(3),
                              torch.tensor([0.0, 1.0 - 1e-7, 0.7], dtype=torch.float64), block=4)
    assert got.tolist() == [0, 4, 1]
