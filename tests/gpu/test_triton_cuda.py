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
