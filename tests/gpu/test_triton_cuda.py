"""GPU check: the Triton MoE and MLA kernels against the torch reference on CUDA at Kimi K2.6 per-rank
shapes (TP 8), and the tiny Kimi INT4 model with every backend pair giving the reference's greedy tokens,
with and without DDTree (benchmarks/gpu_triton_check.py holds the checks and prints their times)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_triton_moe_kernels_match_reference_on_cuda():
    from benchmarks.gpu_triton_check import check_moe

    assert check_moe(16, {}, "cuda", tiny=False)


def test_triton_mla_kernels_match_reference_on_cuda():
    from benchmarks.gpu_triton_check import check_mla

    assert check_mla({}, "cuda", tiny=False)


def test_triton_mla_split_k_matches_reference_on_cuda():
    from benchmarks.gpu_triton_check import check_mla_split

    assert check_mla_split({}, "cuda", tiny=False)


def test_tiny_kimi_backends_agree_on_cuda():
    from benchmarks.gpu_triton_check import check_engine

    assert check_engine({}, 8, "cuda")


def test_triton_sampling_matches_reference_on_cuda():
    """The sampling kernel at Kimi's vocabulary (163,840) on CUDA against the torch reference on CPU: 64 rows
    with every filter; at most one row may differ (a uniform within float32 rounding of a CDF boundary)."""
    from ddtree_serve.kernels.triton_sampling import triton_draw_sampled
    from ddtree_serve.model_executor.sampler import BatchSamplingInfo, draw_tokens
    from ddtree_serve.model_executor.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    n, vocab = 64, 163840
    logits = torch.randn(n, vocab, generator=gen) * 3
    params = [SamplingParams(temperature=(0.6, 1.0)[i % 2], top_k=(0, 40)[(i // 2) % 2],
                             top_p=(1.0, 0.9)[(i // 4) % 2], min_p=(0.0, 0.05)[(i // 8) % 2]) for i in range(n)]
    info = BatchSamplingInfo.build(params, vocab, torch.device("cpu"))
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    want = draw_tokens(logits, info, u)
    got = triton_draw_sampled(logits.cuda(), info.temperature, info.top_k, info.top_p, info.min_p, u.cuda())
    assert int((got.cpu() != want).sum()) <= 1
