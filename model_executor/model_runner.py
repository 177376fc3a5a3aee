"""Owns one model on one device (one TP rank): weights, KV cache, slot allocator, request->token table,
and the attention backend. ``forward(fb)`` runs the model; scheduling lives elsewhere."""

from __future__ import annotations

import logging
import time

import torch

from kernels.attention import TorchAttentionBackend
from kernels.sampling import warm_up_filters
from model_executor.forward_batch import ForwardBatch
from model_executor.kv_cache import KVCache, KVCacheLayout, ReqToTokenPool, TokenSlotAllocator
from model_executor.model_config import ModelConfig
from model_executor.model_registry import get_model_class
from model_executor.models.output import ModelOutput
from model_executor.parallel_state import TPGroup
from model_executor.weight_loader import iter_weights

logger = logging.getLogger(__name__)


def pick_attention_backend(device: torch.device, dtype: torch.dtype, layout: KVCacheLayout, name: str = "auto"):
    """The attention backend for a model of ``dtype`` whose KV cache has ``layout`` (``name``: auto | torch |
    flashinfer, from ``--attention-backend``; auto = flashinfer on CUDA when the dtype and head dims fit it,
    kernels.attention_select). A layout without a V buffer (MLA) is a model that runs its own latent
    attention (torch or triton) and never calls the backend."""
    if layout.v_dim == 0 or name in ("torch", "triton"):
        return TorchAttentionBackend()
    from kernels.attention_select import get_attention_backend

    return get_attention_backend(name, device, dtype, layout.k_dim, layout.v_dim)


def warm_up_attention(backend, layout: KVCacheLayout, model: torch.nn.Module, dtype: torch.dtype,
                      device: torch.device) -> None:
    """JIT-compile and run each kernel of a compiling backend (flashinfer) once at start-up, so the first
    request does not pay for it and the server turns healthy only afterwards. No-op for the reference."""
    if not hasattr(backend, "warmup"):
        return
    num_q = model.layers[0].self_attn.local_heads  # llama-style models and DFlash drafters
    t0 = time.time()
    ran = backend.warmup(num_q, layout.kv_heads, layout.k_dim, layout.v_dim, dtype, device)
    logger.info("attention kernels warmed up in %.1fs: %s", time.time() - t0, ", ".join(ran))


def load_model(config: ModelConfig, tp: TPGroup, device: torch.device) -> torch.nn.Module:
    t0 = time.time()
    cls = get_model_class(config.architecture)
    with torch.device(device):
        model = cls(config, tp)
    model.load_weights(iter_weights(config.path, desc=f"Loading {config.architecture}",
                                    skip_prefixes=getattr(model, "skip_weight_prefixes", ()), lazy=tp.size > 1))
    model.eval()
    logger.info("loaded %s in %.1fs", config.path, time.time() - t0)
    return model


class ModelRunner:
    def __init__(self, config: ModelConfig, max_total_tokens: int | None, kv_memory_gb: float, max_reqs: int,
                 max_context: int, tp: TPGroup = TPGroup(), device: str = "cpu", cuda_graph_max_bs: int = 0):
        """``cuda_graph_max_bs > 0``: replay DECODE / TARGET_VERIFY forwards of up to that many requests from
        CUDA graphs (model_executor/cuda_graph_runner.py; MLA models with the Triton backends only)."""
        self.config = config
        self.device = torch.device(device)
        self.tp = tp
        self.model = load_model(config, tp, self.device)
        layout = self.model.kv_cache_layout()
        per_token = layout.bytes_per_token(config.dtype)
        if max_total_tokens is None:
            max_total_tokens = int(kv_memory_gb * (1 << 30) // per_token)
            max_total_tokens = min(max_total_tokens, max_reqs * max_context)
        if tp.size > 1:  # ranks may hold different KV heads: every rank must schedule the same capacity
            max_total_tokens = tp.min_int(max_total_tokens)
        if max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {max_total_tokens}")
        self.num_slots = max_total_tokens
        self.kv = KVCache(layout, max_total_tokens, config.dtype, self.device)
        self.allocator = TokenSlotAllocator(max_total_tokens, self.device)
        self.req_to_token = ReqToTokenPool(max_reqs, max_context, self.device)
        self.backend = pick_attention_backend(self.device, config.dtype, layout, config.attention_backend)
        warm_up_attention(self.backend, layout, self.model, config.dtype, self.device)
        if self.device.type == "cuda":  # flashinfer's sampling module JIT-compiles at first use
            logger.info("sampling filters warmed up: %s", warm_up_filters(self.device, config.vocab_size))
        self.graphs = None
        if cuda_graph_max_bs > 0:
            from model_executor.cuda_graph_runner import CudaGraphRunner, check_graphable, graph_batch_sizes

            check_graphable(config)
            self.graphs = CudaGraphRunner(self.model, self.kv, self.backend, graph_batch_sizes(cuda_graph_max_bs),
                                          max_context, self.device)
        logger.info("KV cache: %d tokens x %d bytes", max_total_tokens, per_token)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ModelOutput:
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.forward(fb)
        return self.model(fb, self.kv, self.backend)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
