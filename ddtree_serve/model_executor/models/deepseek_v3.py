"""DeepSeek-V3 decoder (Kimi K2 / K2-Thinking; Kimi K2.5/K2.6's text model: models/kimi_k25.py), on our layers.

MLA attention (ddtree_serve/model_executor/layers/mla.py, latent-only KV cache), dense MLP in the first
``first_k_dense_replace`` layers, DeepSeek MoE (layers/moe.py) after. Same model interface as
models/llama.py. Weights: BF16 safetensors in the Hugging Face layout; routed experts may be
compressed-tensors pack-quantized INT4: dequantized at load (``ModelConfig.int4_experts == "dequant"``, the
CPU default) or kept INT4-resident (``"packed"``, the CUDA default: layers/moe_int4.py).
Kernels: ``ModelConfig.attention_backend`` ("torch" | "triton") picks the MLA latent attention and
``ModelConfig.moe_backend`` ("torch" | "triton") the routed experts (dense or INT4-resident).
Multi-token-prediction layers (``model.layers.{n >= num_hidden_layers}``) are not served and are skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from ddtree_serve.kernels.attention import AttentionBackend
from ddtree_serve.model_executor.forward_batch import ForwardBatch
from ddtree_serve.model_executor.kv_cache import KVCache, KVCacheLayout
from ddtree_serve.model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ddtree_serve.model_executor.layers.mla import MLAAttention
from ddtree_serve.model_executor.layers.moe import DeepseekMoE, DenseMLP
from ddtree_serve.model_executor.layers.norm import RMSNorm
from ddtree_serve.model_executor.model_config import ModelConfig
from ddtree_serve.model_executor.models.output import ModelOutput, capture_hidden
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.quantization import Int4Config, PackedWeightAssembler
from ddtree_serve.model_executor.weight_loader import load_param

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_PACKED_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight_(packed|scale|shape)$")
_STACKED_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up|down)_proj$")  # transformers-5 fused
_LAYER = re.compile(r"^layers\.(\d+)\.")
_MLP_STACK = (("gate_proj", 0), ("up_proj", 1))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_id: int, tp: TPGroup, dtype: torch.dtype, int4_group: int | None = None,
                 attention_backend: str = "torch", moe_backend: str = "torch"):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = MLAAttention(cfg, layer_id, tp, dtype, attention_backend)
        dense = layer_id < (cfg.get("first_k_dense_replace") or 0) or not cfg.get("n_routed_experts")
        self.mlp = (DenseMLP(hidden, cfg["intermediate_size"], tp, dtype) if dense
                    else DeepseekMoE(cfg, tp, dtype, int4_group, moe_backend))
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, k_cache: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor], k_scale: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), fb, k_cache, cos_sin, k_scale)  # [T, H]
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3ForCausalLM(nn.Module):
    """Checkpoint names ``model.*`` and ``lm_head.weight``; ``weight_prefix`` is stripped first (wrappers)."""

    weight_prefix = ""
    skip_weight_prefixes: tuple[str, ...] = ()
    supports_dcp = True  # MLA latent KV shards over a decode-context-parallel group (layers/dcp_attention.py)

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        cfg, dtype = config.hf, config.dtype
        self.config, self.tp = config, tp
        self.num_layers = cfg["num_hidden_layers"]
        self.int4_group = _resident_int4_group(config)
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp, dtype)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(cfg, i, tp, dtype, self.int4_group,
                                                           config.attention_backend, config.moe_backend)
                                    for i in range(self.num_layers))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)
        self.tie = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], tp, dtype)

    @property
    def reads_attn_mask(self) -> bool:
        """Whether forwards need ``ForwardBatch.attn_mask`` dense: the torch MLA reference reads it; the
        Triton kernels bound keys by the lengths and read only ``tree_mask`` (ddtree_serve/model_executor/forward_batch.py)."""
        return self.config.attention_backend != "triton"

    def kv_cache_layout(self) -> KVCacheLayout:
        """One latent "head" of kv_lora_rank + qk_rope_head_dim per token and layer, no V buffer."""
        return KVCacheLayout(self.num_layers, 1, self.layers[0].self_attn.latent_dim, 0)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def forward(self, fb: ForwardBatch, kv: KVCache, backend: AttentionBackend) -> ModelOutput:
        """MLA runs its own latent attention (``config.attention_backend``: torch reference or the Triton
        kernels); the runner's MHA ``backend`` is unused here."""
        h = fb.input_embeds if fb.input_embeds is not None else self.embed_tokens(fb.input_ids)  # [T, H]
        cos_sin = self.layers[0].self_attn.rotary.cos_sin(fb.positions)
        captured = []
        for i, layer in enumerate(self.layers):
            h = layer(h, fb, kv.k[i], cos_sin, kv.k_scale[i])
            if i in fb.capture_layer_ids:
                captured.append(h)
        return ModelOutput(self.norm(h), capture_hidden(captured, fb.capture_layer_ids))

    def _map_name(self, name: str) -> tuple[str, object]:
        """Checkpoint name (prefixes stripped) -> (our parameter name, shard id)."""
        m = _PACKED_EXPERT.match(name) if self.int4_group is not None else None
        if m:  # INT4-resident experts: packed words and scales load as they are
            w = "w2" if m.group(3) == "down" else "w13"
            return f"{m.group(1)}.{w}_{m.group(4)}", (int(m.group(2)), m.group(3))
        m = _EXPERT.match(name)
        if m:
            kind = m.group(3)
            return f"{m.group(1)}.{'w2' if kind == 'down' else 'w13'}", (int(m.group(2)), kind)
        m = _STACKED_EXPERTS.match(name)
        if m:
            return f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up' else 'w2'}", (None, m.group(2))
        for src, sid in _MLP_STACK:
            if f".{src}." in name:
                return name.replace(f".{src}.", ".gate_up_proj."), sid
        return name, None

    def _strip(self, name: str) -> str | None:
        if self.weight_prefix:
            if not name.startswith(self.weight_prefix):
                return None
            name = name[len(self.weight_prefix):]
        if "rotary_emb" in name:
            return None
        name = name.removeprefix("model.")
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= self.num_layers:  # MTP / next-n layers
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.text_parameters()
        loaded: set[str] = set()
        assembler = PackedWeightAssembler(self.config.dtype)
        skipped = 0
        for raw, tensor in weights:
            if self.skip_weight_prefixes and raw.startswith(self.skip_weight_prefixes):
                skipped += 1
                continue
            name = self._strip(raw)
            if name is None:
                skipped += 1
                continue
            resident = self.int4_group is not None and _PACKED_EXPERT.match(name) is not None
            if resident and name.endswith(".weight_shape"):
                continue  # INT4-resident experts: the dense shape is implied by the parameters
            if not resident and assembler.is_packed(name):
                done = assembler.feed(name, tensor)
                if done is None:
                    continue
                name, tensor = done
            target, shard = self._map_name(name)
            load_param(params, target, tensor, shard, f"checkpoint (from {raw!r})")
            loaded.add(target)
            if self.tie and target == "embed_tokens.weight":
                self.lm_head.weight.weight_loader(self.lm_head.weight, tensor, None)
                loaded.add("lm_head.weight")
        assembler.finish()
        self._after_load(skipped)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")

    def text_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters ``load_weights`` fills from the text model's tensors (a wrapper's own modules aside)."""
        return dict(self.named_parameters())

    def _after_load(self, skipped: int) -> None:
        if skipped:
            logger.info("%s: skipped %d checkpoint tensors (MTP layers / rotary buffers)", type(self).__name__,
                        skipped)


def _resident_int4_group(config: ModelConfig) -> int | None:
    """The INT4 group size when routed experts stay pack-quantized in memory: the checkpoint quantizes them
    and ``config.int4_experts == "packed"``; None otherwise."""
    if config.int4_experts != "packed" or not config.path:
        return None
    quant = Int4Config.from_model_dir(config.path)
    if quant is None or not quant.is_quantized("model.layers.1.mlp.experts.0.gate_proj"):
        return None
    return quant.group_size
