"""A windowed DFlash drafter (models/dflash_window.py; the K2.6-style sliding + full layers, a context cap on
top) drafts on CUDA what it drafts on CPU: the torch backend in float32, and flashinfer's custom-mask prefill
(the drafter's serving backend on CUDA: one plan per run of layers of the same kind) in bfloat16."""

from __future__ import annotations

import pytest
import torch

from ddtree_serve.kernels.dispatch import FLASHINFER, use_cuda_kernels
from tests.model_executor.test_dflash_window import KINDS, inputs, make_drafter, paged_draft

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("cap", [None, 6])
def test_windowed_drafter_on_cuda_matches_cpu(cap, backend_report):
    model, _ = make_drafter(KINDS["k26_style"])
    model.draft_window = cap
    feats, embeds = inputs()
    want = paged_draft(model, feats, embeds)  # CPU, float32, torch reference
    cuda = model.to("cuda")
    got = paged_draft(cuda, feats, embeds, "cuda")
    torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=1e-3)
    backend_report.append(f"windowed drafter (cap {cap}): torch backend on CUDA, float32 vs CPU")
    if not use_cuda_kernels(torch.zeros(1, device="cuda"), library=FLASHINFER):
        pytest.skip("flashinfer not usable")
    from ddtree_serve.kernels.attention_flashinfer import FlashInferAttentionBackend

    bf16, _ = make_drafter(KINDS["k26_style"], dtype=torch.bfloat16)  # the same weights, rounded
    bf16 = bf16.to("cuda")
    bf16.draft_window = cap
    got = paged_draft(bf16, feats, embeds, "cuda", FlashInferAttentionBackend())
    torch.testing.assert_close(got.float().cpu(), want, atol=0.1, rtol=0.1)
    backend_report.append(f"windowed drafter (cap {cap}): flashinfer custom-mask prefill, bf16 vs CPU float32")
