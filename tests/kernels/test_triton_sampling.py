"""The radix-select sampling kernel (ddtree_serve/kernels/triton_sampling.py) against the torch reference of
``draw_tokens`` (softmax(l / T), top-k, top-p, min-p, inverse CDF) and against the bisection kernel it replaces
(kernels/triton_sampling_bisect.py), under Triton's interpreter on CPU; and its passes over the row."""

from __future__ import annotations

import torch

from ddtree_serve.kernels.triton_sampling import triton_draw_sampled
from ddtree_serve.kernels.triton_sampling_bisect import bisect_passes, triton_draw_sampled_bisect
from ddtree_serve.model_executor.sampler import BatchSamplingInfo, draw_tokens
from ddtree_serve.model_executor.sampling_params import SamplingParams


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=(0.4, 0.9, 1.3)[i % 3], top_k=(0, 3, 17, 60)[i % 4],
                          top_p=(1.0, 0.9, 0.5)[(i // 2) % 3], min_p=(0.0, 0.0, 0.1)[(i // 3) % 3])


def _draw(logits: torch.Tensor, info: BatchSamplingInfo, u: torch.Tensor, block: int,
          passes: torch.Tensor | None = None) -> torch.Tensor:
    return triton_draw_sampled(logits, info.temperature, info.top_k, info.top_p, info.min_p, u, block=block,
                               passes_out=passes)


def test_kernel_equals_reference_and_bisection_on_random_rows() -> None:
    """48 rows over a vocabulary of 70 (blocks of 32: a partial last block), every filter combination, with
    ties in some rows (repeated logits); the kernel's tokens equal the reference's and the bisection kernel's."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 48, 70
    logits = torch.randn(n, vocab, generator=gen) * 2
    logits[::5, 10:20] = logits[::5, 10:11]  # ties at the top-k / top-p boundary
    params = [_params(i) for i in range(n)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    want = draw_tokens(logits, info, u)
    got = _draw(logits, info, u, 32)
    assert torch.equal(got, want), (got - want).nonzero()[:, 0].tolist()
    old = triton_draw_sampled_bisect(logits, info.temperature, info.top_k, info.top_p, info.min_p, u, block=32)
    assert torch.equal(got, old)


def test_kernel_edge_rows() -> None:
    """top_k 1, top_p 1 (off), an all-equal row, -inf masked entries (a grammar mask; top-k larger than the
    finite entries), a tie spanning the top-k boundary, top-p and min-p deciding: each against the reference at
    several uniforms."""
    vocab = 40
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(vocab, generator=gen) * 1.5
    masked = base.clone()
    masked[::3] = -float("inf")  # 14 of 40 masked
    tied = base.clone()
    tied[5:12] = tied.max() - 0.5  # 7 equal logits around the 3rd-largest value
    cases = [
        (base, SamplingParams(temperature=0.8, top_k=1)),
        (base, SamplingParams(temperature=1.1, top_p=1.0)),
        (torch.full((vocab,), 0.25), SamplingParams(temperature=0.7, top_k=5, top_p=0.6)),
        (masked, SamplingParams(temperature=1.0, top_k=30)),
        (masked, SamplingParams(temperature=0.9, top_p=0.8)),
        (tied, SamplingParams(temperature=1.0, top_k=3)),
        (tied, SamplingParams(temperature=1.0, top_k=10, top_p=0.3)),
        (base, SamplingParams(temperature=2.0, top_p=0.05)),
        (base, SamplingParams(temperature=1.0, top_k=20, min_p=0.3)),
        (base, SamplingParams(temperature=0.5, min_p=0.2)),
    ]
    u = torch.tensor([0.0, 0.13, 0.5, 0.77, 1.0 - 1e-7], dtype=torch.float64)
    logits = torch.stack([row for row, _ in cases]).repeat_interleave(len(u), 0)  # [cases * 5, V]
    params = [p for _, p in cases for _ in u]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    uu = u.repeat(len(cases))
    want = draw_tokens(logits, info, uu)
    got = _draw(logits, info, uu, 16)
    assert torch.equal(got, want), (got - want).nonzero()[:, 0].tolist()


def test_kernel_edges() -> None:
    """u = 0 picks the first kept token; u just below 1 the last kept one; top-k 1 is the argmax; top_p 0 keeps
    the maximum."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0]] * 4)
    t = torch.ones(4)
    got = triton_draw_sampled(logits, t, torch.tensor([5, 5, 1, 5]), torch.tensor([1.0, 1.0, 1.0, 0.0]),
                              torch.zeros(4), torch.tensor([0.0, 1.0 - 1e-7, 0.7, 0.9], dtype=torch.float64),
                              block=16)
    assert got.tolist() == [0, 4, 1, 1]


def test_kernel_at_a_larger_vocabulary() -> None:
    """24 rows over 3,000 tokens in blocks of 128 (the default), peaked and flat rows: equal to the reference."""
    gen = torch.Generator().manual_seed(2)
    n, vocab = 24, 3000
    logits = torch.randn(n, vocab, generator=gen) * torch.linspace(0.5, 6.0, n)[:, None]
    params = [_params(i) for i in range(n)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    assert torch.equal(_draw(logits, info, u, 128), draw_tokens(logits, info, u))


def test_passes_per_row() -> None:
    """Full reads of the row, counted by the kernel: 2 with no filter, 3 with min-p alone, 4 with top-k or top-p
    alone, 4-6 with both (top-p's digits reuse top-k's histograms while they agree), against the bisection
    kernel's 3 / 3 / 33-34 / 64."""
    gen = torch.Generator().manual_seed(3)
    vocab = 300
    logits = (torch.randn(vocab, generator=gen) * 2).repeat(7, 1)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=200, top_p=0.5),  # top-p's threshold far above top-k's
              SamplingParams(temperature=1.0, top_k=2, top_p=0.99),  # top-p keeps both survivors: same digits
              SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    passes = torch.zeros(7, dtype=torch.int32)
    u = torch.full((7,), 0.5, dtype=torch.float64)
    assert torch.equal(_draw(logits, info, u, 64, passes), draw_tokens(logits, info, u))
    got = passes.tolist()
    assert got[:4] == [2, 3, 4, 4] and got[5] == 4 and 4 <= got[4] <= 6 and 4 <= got[6] <= 6, got
    assert bisect_passes(True, True) == 64 and bisect_passes(True, False) == 33
    assert bisect_passes(True, True) / max(got) >= 10
