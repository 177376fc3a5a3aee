"""flashinfer sampling glue (ddtree_serve/kernels/sampling.py) against a recording stand-in for flashinfer.sampling:
the renorm filters are always called with ``is_deterministic=True`` (TP ranks and seeded replays need
bit-identical filtering), and a flashinfer without that argument is not used (the deterministic torch
reference runs), or is an error under DDTREE_REQUIRE_CUDA_KERNELS=1. The CUDA dispatch decision is
forced on, since no CUDA tensor exists here."""

from __future__ import annotations

import pytest
import torch

import ddtree_serve.kernels.sampling as sampling
from ddtree_serve.kernels.dispatch import CudaKernelUnavailable
from tests.kernels.flashinfer_standin import SamplingStandin


def _route_to(monkeypatch, standin: SamplingStandin) -> None:
    monkeypatch.setattr(sampling, "use_cuda_kernels", lambda *t, library: library == "flashinfer.sampling")
    monkeypatch.setattr(sampling, "import_cuda_library", lambda name: standin)


def _probs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(6, 300, generator=g) * 3).softmax(-1)


def test_filters_pass_the_deterministic_flag(monkeypatch):
    probs = _probs()
    k = torch.tensor([1, 5, 0, 40, 300, 7])  # 0 and V disable the row
    p = torch.tensor([0.5, 0.9, 1.0, 0.3, 0.99, 0.0])
    ref_k, ref_p = sampling.top_k_renorm_prob(probs, k), sampling.top_p_renorm_prob(probs, p)
    standin = SamplingStandin()
    _route_to(monkeypatch, standin)
    got_k, got_p = sampling.top_k_renorm_prob(probs, k), sampling.top_p_renorm_prob(probs, p)
    assert standin.calls == [
        ("top_k_renorm_probs", {"is_deterministic": True}),
        ("top_p_renorm_probs", {"is_deterministic": True}),
    ]
    assert torch.allclose(got_k, ref_k, atol=1e-6) and torch.allclose(got_p, ref_p, atol=1e-6)
    assert torch.equal(got_k[2], probs[2]) and torch.equal(got_p[2], probs[2])  # disabled rows untouched


def test_flashinfer_without_deterministic_mode_is_not_used(monkeypatch):
    probs = _probs()
    ref = sampling.top_p_renorm_prob(probs, 0.8)
    standin = SamplingStandin(with_flag=False)
    _route_to(monkeypatch, standin)
    assert torch.equal(sampling.top_p_renorm_prob(probs, 0.8), ref)  # the reference ran
    assert standin.calls == []
    monkeypatch.setenv("DDTREE_REQUIRE_CUDA_KERNELS", "1")
    with pytest.raises(CudaKernelUnavailable, match="is_deterministic"):
        sampling.top_k_renorm_prob(probs, 3)
