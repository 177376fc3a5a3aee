"""Owns one model on one device (one TP rank): weights, KV cache, slot allocator, request->token table,
and the attention backend. ``forward(fb)`` runs the model; scheduling lives elsewhere."""

from __future__ import annotations

import logging
import time

import torch

from kernels.attention import TorchAttentionBackend
from model_executor.forward_batch import ForwardBatch
from model_executor.kv_cache import KVCache, ReqToTokenPool, TokenSlotAllocator
from model_executor.model_config import ModelConfig
from model_executor.model_registry import get_model_class
from model_executor.models.output import ModelOutput
from model_executor.parallel_state import TPGroup
from model_executor.weight_loader import iter_weights

logger = logging.getLogger(__name__)


def pick_attention_backend(device: torch.device):
    try:
        from kernels.attention_select import get_attention_backend
    except ImportError:
        return TorchAttentionBackend()
    return get_attention_backend("auto", device)


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
    """Loads the weights at construction. The KV cache is allocated then when ``max_total_tokens`` is given;
    otherwise the owner sizes it once everything else is resident (``model_executor.memory``) and calls
    ``allocate_kv``."""

    def __init__(self, config: ModelConfig, max_reqs: int, max_context: int, tp: TPGroup = TPGroup(),
                 device: str = "cpu", max_total_tokens: int | None = None):
        self.config = config
        self.device = torch.device(device)
        self.tp = tp
        self.max_reqs, self.max_context = max_reqs, max_context
        self.model = load_model(config, tp, self.device)
        self.kv_layout = self.model.kv_cache_layout()
        self.num_slots = 0
        self.backend = pick_attention_backend(self.device)
        if max_total_tokens is not None:
            self.allocate_kv(max_total_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_layout.bytes_per_token(self.config.dtype)

    def allocate_kv(self, num_slots: int, table_margin: int = 0) -> None:
        """Allocate the KV cache, slot allocator and request->token table (once). ``table_margin``: extra
        table columns past ``max_context`` for the temporary slots of a step (a draft block or a tree
        written after the last cached position of a request at the context limit)."""
        if self.num_slots:
            raise RuntimeError("the KV cache is already allocated")
        if num_slots < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {num_slots}")
        self.num_slots = num_slots
        self.kv = KVCache(self.kv_layout, num_slots, self.config.dtype, self.device)
        self.allocator = TokenSlotAllocator(num_slots, self.device)
        self.req_to_token = ReqToTokenPool(self.max_reqs, self.max_context + table_margin, self.device)
        logger.info("KV cache: %d tokens x %d bytes", num_slots, self.kv_bytes_per_token)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ModelOutput:
        return self.model(fb, self.kv, self.backend)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
