"""Shared fixtures: the default model (converted once) and tiny random HF checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Without CUDA, Triton kernels run on CPU tensors in Triton's interpreter (read when a kernel is defined, so
# set before any test imports ddtree_serve/kernels/triton_*.py; subprocesses such as Engine followers inherit it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from ddtree_serve.model_executor.default_model import ensure_default_model

    return ensure_default_model()


def write_tiny_llama_family(path, arch: str = "llama", vocab: int = 256, seed: int = 0, **overrides) -> str:
    """Write a tiny random checkpoint of transformers' own Llama/Qwen2/Qwen3 class in the HF layout."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
              eos_token_id=vocab - 1, bos_token_id=0)
    if arch == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kw)).float()
    with torch.no_grad():
        for p in model.parameters():  # larger random weights: a peaky, non-degenerate distribution
            p.normal_(0, 0.08) if p.dim() > 1 else None
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture
def tiny_llama_factory(tmp_path_factory):
    def make(arch: str = "llama", **kw) -> str:
        return write_tiny_llama_family(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kw)

    return make
