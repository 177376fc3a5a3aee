"""Attention backend selection by device, dtype and head dim (ddtree_serve/kernels/attention_select.py), decided
without CUDA: flashinfer only for 16-bit models with head dims it instantiates; float32 on CUDA gets the
torch reference ("auto") or a clear start-up error ("flashinfer"); the require switch makes a fallback
that should not happen an error."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.attention_select import select_attention_backend
from ddtree_serve.kernels.dispatch import CudaKernelUnavailable


def _pick(name="auto", device="cuda", dtype=torch.bfloat16, hd=64, hdv=64, cuda=True, fi=True):
    return select_attention_backend(name, device, dtype, hd, hdv, cuda_available=cuda, flashinfer_imports=fi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_auto_picks_flashinfer_for_16_bit_supported_head_dims(dtype, hd):
    assert _pick(dtype=dtype, hd=hd, hdv=hd).backend == "flashinfer"


@pytest.mark.parametrize(
    "dtype,hd,hdv", [(torch.float32, 64, 64), (torch.bfloat16, 96, 96), (torch.bfloat16, 128, 64)]
)
def test_auto_falls_back_to_torch_when_flashinfer_cannot_run_it(dtype, hd, hdv, monkeypatch):
    monkeypatch.setenv("DDTREE_REQUIRE_CUDA_KERNELS", "1")  # not a fallback: flashinfer cannot run it
    choice = _pick(dtype=dtype, hd=hd, hdv=hdv)
    assert choice.backend == "torch" and ("16-bit" in choice.reason or "head_dim" in choice.reason)


def test_explicit_flashinfer_with_float32_is_a_clear_error():
    with pytest.raises(ValueError, match="16-bit"):
        _pick("flashinfer", dtype=torch.float32)


def test_cpu_device_and_missing_library(monkeypatch):
    assert _pick(device="cpu").backend == "torch"
    assert _pick(fi=False).backend == "torch"
    assert _pick(cuda=False).backend == "torch"
    with pytest.raises(RuntimeError, match="cannot run"):
        _pick("flashinfer", fi=False)
    monkeypatch.setenv("DDTREE_REQUIRE_CUDA_KERNELS", "1")
    assert _pick(device="cpu").backend == "torch"  # a CPU model is not a fallback
    with pytest.raises(CudaKernelUnavailable):
        _pick(fi=False)
    monkeypatch.setenv("DDTREE_KERNELS", "torch")
    with pytest.raises(CudaKernelUnavailable):
        _pick()


def test_forced_torch_and_unknown_name(monkeypatch):
    monkeypatch.setenv("DDTREE_KERNELS", "torch")
    assert _pick().backend == "torch"
    with pytest.raises(ValueError, match="unknown"):
        _pick("triton")
