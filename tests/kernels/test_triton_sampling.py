"""The radix-select sampling kernel (ddtree_serve/kernels/triton_sampling.py) against the torch reference of
``draw_tokens`` (softmax(l / T), top-k, top-p, min-p, inverse CDF) and against the bisection kernel it replaces
(kernels/triton_sampling_bisect.py), under Triton's interpreter on CPU; and its passes over the row."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.triton_sampling import CAP, triton_draw_sampled
from ddtree_serve.kernels.triton_sampling_bisect import bisect_passes, triton_draw_sampled_bisect
from ddtree_serve.model_executor.sampler import BatchSamplingInfo, draw_tokens
from ddtree_serve.model_executor.sampling_params import SamplingParams


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=(0.4, 0.9, 1.3)[i % 3], top_k=(0, 3, 17, 60)[i % 4],
                          top_p=(1.0, 0.9, 0.5)[(i // 2) % 3], min_p=(0.0, 0.0, 0.1)[(i // 3) % 3])


def _draw(logits: torch.Tensor, info: BatchSamplingInfo, u: torch.Tensor, block: int,
          passes: torch.Tensor | None = None, cap: int = CAP) -> torch.Tensor:
    return triton_draw_sampled(logits, info.temperature, info.top_k, info.top_p, info.min_p, u, block=block,
                               passes_out=passes, cap=cap)


@pytest.fixture(scope="module")
def bisected() -> dict[str, tuple[list[torch.Tensor], torch.Tensor]]:
    """The bisection kernel's tokens by test, shared by that test's ``cap`` cases (``_bisect``)."""
    return {}


def _bisect(cache: dict, test: str, logits: torch.Tensor, info: BatchSamplingInfo, u: torch.Tensor, block: int) -> torch.Tensor:
    """The bisection kernel's tokens for one test's rows. The bisection kernel has no candidate buffer, so its
    tokens do not depend on the radix kernel's ``cap``: they are computed once per test under the interpreter
    (~8-12 s) and shared by its ``cap`` cases, which draw from the same seeded rows (asserted)."""
    inputs = [logits, info.temperature, info.top_k, info.top_p, info.min_p, u]
    if test in cache:
        seen, tokens = cache[test]
        assert all(torch.equal(a, b) for a, b in zip(seen, inputs, strict=True))
        return tokens
    tokens = triton_draw_sampled_bisect(*inputs, block=block)
    cache[test] = ([t.clone() for t in inputs], tokens)
    return tokens


@pytest.mark.parametrize("cap", [CAP, 4])
def test_kernel_equals_reference_and_bisection_on_random_rows(cap: int, bisected) -> None:
    """48 rows over a vocabulary of 70 (blocks of 32: a partial last block), every filter combination, with
    ties in some rows (repeated logits); the kernel's tokens equal the reference's and the bisection kernel's,
    with the candidates buffered (``CAP``) and with a buffer of 4 (most filtered rows take the row-wide path)."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 48, 70
    logits = torch.randn(n, vocab, generator=gen) * 2
    logits[::5, 10:20] = logits[::5, 10:11]  # ties at the top-k / top-p boundary
    params = [_params(i) for i in range(n)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    want = draw_tokens(logits, info, u)
    got = _draw(logits, info, u, 32, cap=cap)
    assert torch.equal(got, want), (got - want).nonzero()[:, 0].tolist()
    old = _bisect(bisected, "random_rows", logits, info, u, 32)
    assert torch.equal(got, old)


@pytest.mark.parametrize("cap", [CAP, 2])
def test_kernel_edge_rows(cap: int, bisected) -> None:
    """top_k 1 (also over a tied maximum and an all-equal row), top_p 1 (off), near 0 and near 1, an all-equal row,
    -inf masked entries (a grammar mask; top-k larger than the finite entries; a row with two finite entries),
    a tie spanning the top-k boundary, top-p and min-p deciding: each against the reference at several uniforms,
    with the candidates buffered and with a buffer of 2 (the row-wide path)."""
    vocab = 40
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(vocab, generator=gen) * 1.5
    masked = base.clone()
    masked[::3] = -float("inf")  # 14 of 40 masked
    tied = base.clone()
    tied[5:12] = tied.max() - 0.5  # 7 equal logits around the 3rd-largest value
    top_tied = base.clone()
    top_tied[[3, 30]] = base.max() + 1.0  # two equal maxima
    two = torch.full((vocab,), -float("inf"))
    two[[7, 21]] = torch.tensor([0.3, -0.4])
    flat = torch.full((vocab,), 0.25)
    cases = [
        (top_tied, SamplingParams(temperature=0.8, top_k=1)),
        (flat, SamplingParams(temperature=1.0, top_k=1)),
        (flat, SamplingParams(temperature=1.0, top_p=1e-6)),
        (base, SamplingParams(temperature=1.0, top_p=1e-6)),
        (base, SamplingParams(temperature=1.0, top_p=0.999999)),
        (masked, SamplingParams(temperature=1.0, top_p=0.999999, top_k=35)),
        (masked, SamplingParams(temperature=1.0, min_p=0.1)),
        (masked, SamplingParams(temperature=1.0)),
        (two, SamplingParams(temperature=1.0, top_k=5)),
        (two, SamplingParams(temperature=1.0, top_p=0.5)),
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
    got = _draw(logits, info, uu, 16, cap=cap)
    # top_k 1 rows are greedy for the sampler (the lowest maximal id); the kernel keeps a tied maximum, as the
    # bisection kernel does
    served = torch.where(info.is_greedy, logits.argmax(-1), got)
    assert torch.equal(served, want), (served - want).nonzero()[:, 0].tolist()
    old = _bisect(bisected, "edge_rows", logits, info, uu, 16)
    assert torch.equal(got, old), (got - old).nonzero()[:, 0].tolist()
    assert set(got[:5].tolist()) == {3, 30}  # the two tied maxima, by the uniform


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
    """Reads of the row, counted by the kernel: 1 and a block or two with no filter (the draw starts at the
    crossing's block); 2 with any filter whose candidates fit the buffer (top-k, top-p, min-p, with each other);
    with a buffer of 4 the row-wide path: 2-3 with min-p (its draw over the row), 3-4 with top-k or top-p, 3-6
    with both (2 still for top-k 2, whose candidates fit). Against the bisection kernel's 3 / 3 / 33-34 / 64: >= 10x
    fewer with top-k or top-p on."""
    gen = torch.Generator().manual_seed(3)
    vocab = 300  # 5 blocks of 64
    logits = (torch.randn(vocab, generator=gen) * 2).repeat(7, 1)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=200, top_p=0.5),  # top-p's threshold far above top-k's
              SamplingParams(temperature=1.0, top_k=2, top_p=0.99),
              SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    u = torch.full((7,), 0.5, dtype=torch.float64)
    want = draw_tokens(logits, info, u)
    passes = torch.zeros(7)
    assert torch.equal(_draw(logits, info, u, 64, passes), want)
    got = passes.tolist()
    assert 1.2 - 1e-6 <= got[0] <= 1.4 + 1e-6 and got[1:] == [2.0] * 6, got
    assert bisect_passes(True, False) / got[2] >= 10 and bisect_passes(False, True) / got[3] >= 10
    assert bisect_passes(True, True) / max(got[4:]) >= 10
    narrow = torch.zeros(7)
    assert torch.equal(_draw(logits, info, u, 64, narrow, cap=4), want)
    got = narrow.tolist()
    assert got[0] == passes[0] and 2 < got[1] <= 3 and 3 < got[2] <= 4 and 3 < got[3] <= 4, got
    assert 3 < got[4] <= 6 and got[5] == 2.0 and 3 < got[6] <= 6, got  # top-k 2's candidates still fit 4


@pytest.mark.parametrize("cap", [CAP, 4])
def test_a_row_draws_the_same_token_alone_and_in_batches(cap: int) -> None:
    """Batch invariance (docs/DESIGN.md 4.18): each row's token and pass count are the same drawn alone, inside
    batches of other sizes and at other offsets (programs loop over rows: a row's draw reads its own logits,
    parameters and uniform only), with the candidates buffered and on the row-wide path."""
    gen = torch.Generator().manual_seed(5)
    n, vocab = 24, 70
    logits = torch.randn(n, vocab, generator=gen) * 2
    params = [_params(i) for i in range(n)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    passes = torch.empty(n)
    batched = _draw(logits, info, u, 32, passes, cap=cap)
    for lo, hi in ((0, 1), (7, 8), (3, 11), (5, 24)):
        rows = slice(lo, hi)
        part = BatchSamplingInfo.build(params[rows], vocab, torch.device("cpu"))
        sub_passes = torch.empty(hi - lo)
        got = _draw(logits[rows].clone(), part, u[rows], 32, sub_passes, cap=cap)
        assert torch.equal(got, batched[rows]) and torch.equal(sub_passes, passes[rows]), (lo, hi)
