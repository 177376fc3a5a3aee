"""The batch sampler: per-request temperature / top-k / top-p / min-p distributions on a tiny vocabulary,
greedy rows, and position-keyed draws (u(seed, t)) independent of the batch."""

from __future__ import annotations

import torch

from ddtree_serve.model_executor.position_uniforms import SampleKeys
from ddtree_serve.model_executor.sampler import BatchSamplingInfo, processed_probs, sample
from ddtree_serve.model_executor.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])


def _expected(p: SamplingParams) -> torch.Tensor:
    """Direct, unvectorised definition: softmax(l/T), keep top-k, keep the smallest top-p prefix, min-p."""
    probs = torch.softmax(LOGITS / p.temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = p.top_k if p.top_k > 0 else len(probs)
    keep[order[:k]] = True
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    cum, kept = 0.0, torch.zeros_like(keep)
    for i in probs.argsort(descending=True).tolist():
        kept[i] = True
        cum += probs[i].item()
        if cum >= p.top_p - 1e-9:
            break
    probs = torch.where(kept, probs, 0.0)
    probs /= probs.sum()
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


CPU = torch.device("cpu")


def _keys(seeds: list[int], positions: list[int] | None = None) -> SampleKeys:
    return SampleKeys.build(seeds, positions if positions is not None else [0] * len(seeds), CPU)


def test_distributions_match_definition():
    """N = 40000 draws per setting, one per seed at position 0; total variation to the exact distribution
    < 0.015 (noise ~0.005), and a chi-square test at a fixed tolerance."""
    from scipy.stats import chisquare

    settings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5),
                SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=1.0, top_p=0.7),
                SamplingParams(temperature=0.8, top_k=5, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.2)]
    n = 40000
    for p in settings:
        params = [p] * n
        info = BatchSamplingInfo.build(params, len(LOGITS), torch.device("cpu"))
        toks = sample(LOGITS.expand(n, -1).clone(), info, _keys(list(range(n))))
        emp = torch.bincount(toks, minlength=len(LOGITS)).float() / n
        exp = _expected(p)
        one = BatchSamplingInfo.build([p], len(LOGITS), torch.device("cpu"))
        torch.testing.assert_close(processed_probs(LOGITS[None], one)[0], exp, atol=1e-6, rtol=1e-5)
        tv = 0.5 * (emp - exp).abs().sum().item()
        assert tv < 0.015, (p, tv)
        assert emp[exp == 0].sum() == 0
        support = exp > 0
        counts = torch.bincount(toks, minlength=len(LOGITS))[support].double()
        expected = exp[support].double() * n
        expected *= counts.sum() / expected.sum()
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4, p


def test_one_seed_over_positions_follows_the_distribution():
    """One seed, 20000 consecutive output positions: the position-keyed stream is itself distributed as
    the processed distribution (chi-square), and repeats exactly."""
    from scipy.stats import chisquare

    p = SamplingParams(temperature=0.9, top_k=6)
    n = 20000
    info = BatchSamplingInfo.build([p] * n, len(LOGITS), CPU)
    toks = sample(LOGITS.expand(n, -1).clone(), info, _keys([7] * n, list(range(n))))
    again = sample(LOGITS.expand(n, -1).clone(), info, _keys([7] * n, list(range(n))))
    assert torch.equal(toks, again)
    exp = _expected(p)
    support = exp > 0
    counts = torch.bincount(toks, minlength=len(LOGITS))[support].double()
    expected = exp[support].double() * n
    assert chisquare(counts.numpy(), (expected * counts.sum() / expected.sum()).numpy()).pvalue > 1e-4


def test_greedy_rows_and_batch_independence():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3), SamplingParams(top_k=1),
              SamplingParams(temperature=0.7), SamplingParams(temperature=2.0)]
    info = BatchSamplingInfo.build(params, 8, torch.device("cpu"))
    toks = sample(logits, info, _keys([0, 3, 2, 11, 12], [5] * 5))
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()
    # request 1 alone, same seed and position -> same token
    alone = sample(logits[1:2], BatchSamplingInfo.build(params[1:2], 8, CPU), _keys([3], [5]))
    assert alone[0] == toks[1]


def test_tiny_temperature_is_greedy_not_nan():
    """A positive temperature below 1e-5 (an OpenAI client may send 1e-300) decodes greedily: logits / T
    would overflow to a NaN probability row."""
    from ddtree_serve.model_executor.sampler import BatchSamplingInfo, sample
    from ddtree_serve.model_executor.sampling_params import SamplingParams

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5]])
    for t in (1e-300, 5e-324, 1e-6):
        p = SamplingParams(temperature=t, max_tokens=1)
        assert p.is_greedy
        info = BatchSamplingInfo.build([p], 4, torch.device("cpu"))
        assert sample(logits, info, _keys([0])).tolist() == [1]


def test_position_uniforms_match_the_python_reference():
    """The int64 tensor mix equals the same mix in Python integers (the wrap-around and logical shifts are
    what CPU and CUDA compute), for any seed (negative and beyond 64 bits too)."""
    from ddtree_serve.model_executor.position_uniforms import position_uniform_reference

    seeds = [0, 1, 7, -3, 2**63 - 1, 2**70 + 5, 123456789]
    keys = _keys(seeds, [0, 5, 9, 100, 3, 1, 2**40])
    u = keys.uniforms(torch.arange(6).expand(len(seeds), 6))  # [7, 6]
    for b, s in enumerate(seeds):
        for j in range(6):
            assert u[b, j].item() == position_uniform_reference(s, keys.positions[b].item() + j)
    assert bool(((u >= 0) & (u < 1)).all())
    assert len(set(u.flatten().tolist())) == u.numel()


def test_draw_tokens_blocks_give_the_same_tokens():
    """Row blocks bound the probability memory; the tokens do not depend on the block size."""
    from ddtree_serve.model_executor.sampler import draw_tokens

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 50, generator=gen)
    params = [SamplingParams(temperature=0.3 + (i % 5) * 0.3, top_k=i % 7, top_p=1.0 - (i % 3) * 0.2)
              if i % 4 else SamplingParams(temperature=0) for i in range(37)]
    info = BatchSamplingInfo.build(params, 50, CPU)
    u = torch.rand(37, generator=gen, dtype=torch.float64)
    whole = draw_tokens(logits, info, u)
    for budget in (1, 50 * 4 * 3 * 2, 50 * 4 * 3 * 10):
        assert torch.equal(draw_tokens(logits, info, u, budget_bytes=budget), whole)
