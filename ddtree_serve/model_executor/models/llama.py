"""Llama-family decoder (Llama/SmolLM2, Qwen2 with qkv bias, Qwen3 with q/k RMSNorm) on our own layers.

Model interface shared by every target model (see ddtree_serve/model_executor/model_registry.py):
``Model(config: ModelConfig, tp: TPGroup)``; ``kv_cache_layout()``; ``forward(fb, kv, backend) ->
ModelOutput``; ``compute_logits(hidden) -> float32 [n, V]``; ``embed(ids)``; ``load_weights(iterable)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ddtree_serve.kernels.attention import AttentionBackend
from ddtree_serve.model_executor.forward_batch import ForwardBatch
from ddtree_serve.model_executor.kv_cache import KVCache, KVCacheLayout
from ddtree_serve.model_executor.layers.activation import silu_and_mul
from ddtree_serve.model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ddtree_serve.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ddtree_serve.model_executor.layers.norm import RMSNorm
from ddtree_serve.model_executor.layers.rotary import RotaryEmbedding
from ddtree_serve.model_executor.model_config import ModelConfig, rope_parameters
from ddtree_serve.model_executor.models.output import ModelOutput, capture_hidden
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.weight_loader import load_named_weights


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, layer_id: int, tp: TPGroup, dtype: torch.dtype, qk_norm: bool, qkv_bias: bool):
        super().__init__()
        hidden = cfg["hidden_size"]
        o_bias = bool(cfg.get("attention_bias", False))
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads", self.n_heads)
        self.head_dim = cfg.get("head_dim") or hidden // self.n_heads
        self.layer_id = layer_id
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, self.n_heads, self.n_kv, qkv_bias or o_bias, tp,
                                          dtype)
        self.local_heads, self.local_kv = self.qkv_proj.local_heads, self.qkv_proj.local_kv
        self.o_proj = RowParallelLinear(self.n_heads * self.head_dim, hidden, o_bias, tp, dtype, unit=self.qkv_proj.o_unit)
        self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype) if qk_norm else None
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(cfg), cfg.get("max_position_embeddings", 4096))

    def forward(self, h: torch.Tensor, fb: ForwardBatch, kv: KVCache, backend: AttentionBackend,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qkv = self.qkv_proj(h)  # [T, (Hq + 2 Hkv) d]
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(-1, self.local_heads, self.head_dim)  # [T, Hq, d]
        k = k.view(-1, self.local_kv, self.head_dim)  # [T, Hkv, d]
        v = v.view(-1, self.local_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary.apply(q, *cos_sin), self.rotary.apply(k, *cos_sin)
        o = backend.forward(q, k, v, kv.k[self.layer_id], kv.v[self.layer_id], fb.out_cache_loc, fb.kv_indices,
                            fb.attn_mask, fb.q_index, self.scale)  # [T, Hq, d]
        return self.o_proj(o.reshape(o.shape[0], -1))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], False, tp, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_id: int, tp: TPGroup, dtype: torch.dtype, qk_norm: bool, bias: bool):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, tp, dtype, qk_norm, bias)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"], tp, dtype)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, kv: KVCache, backend: AttentionBackend,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), fb, kv, backend, cos_sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    qkv_bias = False

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        cfg, dtype = config.hf, config.dtype
        self.config, self.tp = config, tp
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, tp, dtype, self.qk_norm, self.qkv_bias) for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)
        self.tie = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], tp, dtype)

    def kv_cache_layout(self) -> KVCacheLayout:
        a = self.layers[0].self_attn
        return KVCacheLayout(len(self.layers), a.local_kv, a.head_dim, a.head_dim)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def forward(self, fb: ForwardBatch, kv: KVCache, backend: AttentionBackend) -> ModelOutput:
        h = fb.input_embeds if fb.input_embeds is not None else self.embed_tokens(fb.input_ids)  # [T, H]
        cos_sin = self.layers[0].self_attn.rotary.cos_sin(fb.positions)
        backend.begin_forward(fb.attention_meta())  # one plan for every layer of this forward
        captured = []
        for i, layer in enumerate(self.layers):
            h = layer(h, fb, kv, backend, cos_sin)
            if i in fb.capture_layer_ids:
                captured.append(h)
        return ModelOutput(self.norm(h), capture_hidden(captured, fb.capture_layer_ids))

    _STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
                ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = {"embed_tokens.weight": "lm_head.weight"} if self.tie else None
        load_named_weights(dict(self.named_parameters()), weights, self._STACKED, tied=tied)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
