"""Probability filters (flashinfer semantics) and inverse-CDF sampling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree_serve.kernels.sampling import (
    inverse_cdf_sample,
    min_p_renorm_prob,
    sampling_from_probs,
    top_k_renorm_prob,
    top_p_renorm_prob,
)

P = torch.tensor([[0.1, 0.2, 0.2, 0.5, 0.0]])


def test_top_k_keeps_ties_at_kth_value():
    out = top_k_renorm_prob(P, 2)  # k-th value 0.2 is tied: both 0.2 kept
    assert torch.allclose(out, torch.tensor([[0.0, 0.2, 0.2, 0.5, 0.0]]) / 0.9)
    assert torch.allclose(top_k_renorm_prob(P, 1), torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]]))


@pytest.mark.parametrize("k", [0, -1, 5, 7])
def test_top_k_disabled_leaves_row_unchanged(k):
    assert torch.equal(top_k_renorm_prob(P, k), P)


def test_top_k_per_row_tensor():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    out = top_k_renorm_prob(probs, torch.tensor([1, 2, 4]))
    assert torch.allclose(out[0], torch.tensor([1.0, 0, 0, 0]))
    assert torch.allclose(out[1], torch.tensor([0, 0, 0.3, 0.4]) / 0.7)
    assert torch.equal(out[2], probs[2])


def test_top_p_semantics():
    # descending 0.5, 0.2, 0.2, 0.1: mass 0.5 reaches 0.5; 0.6 needs the tied 0.2s (both kept)
    assert torch.allclose(top_p_renorm_prob(P, 0.5), torch.tensor([[0, 0, 0, 1.0, 0]]))
    assert torch.allclose(top_p_renorm_prob(P, 0.6), torch.tensor([[0, 0.2, 0.2, 0.5, 0]]) / 0.9)
    assert torch.allclose(top_p_renorm_prob(P, 0.95), P / P.sum())
    assert torch.equal(top_p_renorm_prob(P, 1.0), P)
    assert torch.allclose(top_p_renorm_prob(P, 0.0), torch.tensor([[0, 0, 0, 1.0, 0]]))


def test_top_p_per_row_and_large_vocab_paths():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50_000, generator=g)
    logits[:3] *= 8  # peaked rows: resolved by the partial top-k; flat rows need the full sort
    probs = logits.softmax(-1)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.9, 0.3, 0.99])
    out = top_p_renorm_prob(probs, top_p)
    for r in range(6):
        if top_p[r] >= 1:
            assert torch.equal(out[r], probs[r])
            continue
        vals = probs[r].sort(descending=True).values
        n_keep = int(((vals.cumsum(0) - vals) < top_p[r]).sum())
        keep = probs[r] >= vals[n_keep - 1]
        assert torch.equal(out[r] > 0, keep)
        assert torch.allclose(out[r].sum(), torch.tensor(1.0))


def test_min_p():
    out = min_p_renorm_prob(P, 0.4)  # keep >= 0.2
    assert torch.allclose(out, torch.tensor([[0.0, 0.2, 0.2, 0.5, 0.0]]) / 0.9)
    assert torch.equal(min_p_renorm_prob(P, 0.0), P)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(-1, 12), p=st.floats(0.05, 1.0))
def test_filters_properties(seed, k, p):
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(4, 10, generator=g) * 2).softmax(-1)
    probs = torch.round(probs * 20) / 20 + 1e-3  # create ties
    probs = probs / probs.sum(-1, keepdim=True)
    for out in (top_k_renorm_prob(probs, k), top_p_renorm_prob(probs, p)):
        assert torch.allclose(out.sum(-1), torch.ones(4), atol=1e-5)
        kept = out > 0
        # kept set is "all values >= some threshold": closed under ties and larger values
        thr = torch.where(kept, probs, torch.full_like(probs, 2.0)).amin(-1, keepdim=True)
        assert torch.equal(kept, probs >= thr)
        ratio = torch.where(kept, out / probs, torch.zeros_like(probs))
        assert torch.allclose(ratio.amax(-1), torch.where(kept, ratio, 1e9).amin(-1))
    kept_k = (top_k_renorm_prob(probs, k) > 0).sum(-1)
    if 0 < k < 10:
        assert (kept_k >= k).all()
    mass = torch.where(top_p_renorm_prob(probs, p) > 0, probs, 0).sum(-1)
    assert (mass >= min(p, 1.0) - 1e-5).all()


def test_sampling_from_probs_edges():
    probs = P.expand(6, 5)
    u = torch.tensor([0.0, 0.09, 0.1, 0.5, 0.99999, 1.0])
    assert sampling_from_probs(probs, u).tolist() == [0, 0, 1, 3, 3, 3]
    # u near 1 with a trailing zero never picks the zero token; all-zero row gives V - 1
    assert inverse_cdf_sample(torch.zeros(1, 4), torch.tensor([0.3])).tolist() == [3]
    assert inverse_cdf_sample(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0.0])).tolist() == [1]


def test_sampling_from_probs_distribution():
    g = torch.Generator().manual_seed(0)
    probs = (torch.randn(1, 50, generator=g) * 2).softmax(-1)
    probs[0, ::7] = 0
    probs = probs / probs.sum()
    n = 200_000
    draws = sampling_from_probs(probs.expand(n, 50), torch.rand(n, generator=g))
    freq = torch.bincount(draws, minlength=50).double() / n
    tv = 0.5 * (freq - probs[0].double()).abs().sum().item()
    assert tv < 0.01  # expected ~0.004 at 200k draws over 42 outcomes
    assert (freq[probs[0] == 0] == 0).all()


def test_invalid_inputs():
    with pytest.raises(ValueError, match="probs"):
        top_k_renorm_prob(torch.ones(5), 2)
    with pytest.raises(ValueError, match="top_k"):
        top_k_renorm_prob(P, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="top_p"):
        top_p_renorm_prob(P, float("nan"))
    with pytest.raises(ValueError, match="uniforms"):
        sampling_from_probs(P, torch.tensor([1.5]))
    with pytest.raises(ValueError, match="uniforms"):
        sampling_from_probs(P, torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="probs"):
        sampling_from_probs(-P, torch.tensor([0.1]))
