"""DFlash block-diffusion drafter (arXiv 2602.06036; checkpoint format of github z-lab/dflash, docs/DESIGN.md 4.5).

A few Qwen3-style decoder layers (q/k RMSNorm, RoPE, SwiGLU) without embedding or LM head (the target's
are used). Conditioning: the target's hidden states at ``target_layer_ids`` (output of decoder layer l)
are concatenated, projected by ``fc`` and normalised by ``hidden_norm``; this context feature enters
EVERY draft layer as extra keys/values (that layer's k_proj/v_proj, k_norm and RoPE at the context
token's position; no input layernorm). Queries come from the block ``[anchor, MASK x (B-1)]`` only; the
block sees all context before the anchor and itself bidirectionally. Outputs at block positions 1..B-1
go through the target's LM head.

Two paths share the same weights and math:
- paged inference: ``write_context`` stores projected context K/V in the drafter's own paged cache at the
  slot ids the target uses for those tokens; ``forward(fb, kv, backend)`` runs a TARGET_VERIFY-mode batch
  of blocks whose prefix is the committed context and whose block K/V go to temporary slots;
  ``forward_block`` is the same forward from device tensors of static shape alone (the block K/V stay tensors,
  the attention is ``kernels/dflash_attention.py``'s, bounded on the device), so a CUDA graph can capture it
  (speculative/draft_graphs.py);
- dense training: ``forward_train`` over padded tensors with an explicit attention mask.

Layer kinds as the checkpoint declares them (``layer_types``, ``sliding_window``, ``use_sliding_window``,
``max_window_layers``, ``is_causal``; ``dflash_window.py``): a sliding layer's queries see only the keys within
its window, a causal layer's block queries only earlier block keys; the paged path reads only a layer's
visible context, the dense path masks it. ``draft_window`` (``--speculative-dflash-draft-window-size``) caps every
layer's context.

Optional (``dflash_config.conv_kernel_size`` > 0, DFlash2's convolution without its candidate selector): every
layer wraps its attention and MLP in a grouped dynamic causal convolution over each block's tokens
(``dflash_conv.py``); both paths apply it block by block.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.kernels.attention import AttentionBackend
from ddtree_serve.kernels.dflash_attention import dflash_block_attention_reference
from ddtree_serve.model_executor.forward_batch import ForwardBatch
from ddtree_serve.model_executor.kv_cache import KVCache, KVCacheLayout
from ddtree_serve.model_executor.layers.activation import silu_and_mul
from ddtree_serve.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from ddtree_serve.model_executor.layers.norm import RMSNorm
from ddtree_serve.model_executor.layers.rotary import RotaryEmbedding
from ddtree_serve.model_executor.model_config import ModelConfig, rope_parameters
from ddtree_serve.model_executor.models.dflash_conv import (
    GroupedDynamicCausalConv,
    check_no_candidate_selector,
    conv_finish,
    conv_prepare,
    conv_settings,
)
from ddtree_serve.model_executor.models.dflash_keys import check_implemented
from ddtree_serve.model_executor.models.dflash_window import (
    DraftAttention,
    layer_attention,
    visibility,
    windowed_batch,
)
from ddtree_serve.model_executor.parallel_state import TPGroup
from ddtree_serve.model_executor.weight_loader import load_named_weights

CosSin = tuple[torch.Tensor, torch.Tensor]


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Evenly spaced from 1 to N-3 (z-lab's rule; one feature layer -> the middle layer). A target too shallow
    for that range (N <= 2, where N-3 < 0) gets its ids clamped into its layers ``[0, N-1]``, so every id is a
    layer the target has for any N >= 1 (ids may repeat there; the capture serves a repeated id twice)."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]
    return [min(max(i, 0), num_target_layers - 1) for i in ids]


def check_target_layers(ids: tuple[int, ...], num_target_layers: int, path: str) -> None:
    """ValueError naming the drafter and its ``target_layer_ids`` that the target does not have (a drafter
    trained for a deeper target), instead of a failed capture at the first forward."""
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"the DFlash drafter at {path} reads target layers {bad} (target_layer_ids "
                         f"{list(ids)}), but the target has {num_target_layers} layers (0-{num_target_layers - 1}): "
                         "it was trained for another target")


def drafter_group(hf: dict, tp: TPGroup) -> TPGroup:
    """The TP group a DFlash drafter with config ``hf`` runs in: the target's, when its KV heads split over the
    ranks (at least one KV head per rank; query heads follow their KV head); otherwise, with fewer KV heads
    than ranks, a single-rank group, so the whole drafter runs unsharded on every rank. Unsharded ranks
    draft alike: the drafter's inputs (the target's all-reduced captured features and embeddings) and its
    weights are equal on every rank, and the target's vocab-parallel lm_head projects its states. Decode
    context parallelism is the target's alone: the drafter keeps its own unsharded cache (no DCP group)."""
    n_kv = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    if n_kv < tp.size:
        return TPGroup()
    return tp if tp.dcp_size == 1 else dataclasses.replace(tp, dcp_size=1, dcp_group=None)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: dict, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden = cfg["hidden_size"]
        bias = bool(cfg.get("attention_bias", False))
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads", self.n_heads)
        self.head_dim = cfg.get("head_dim") or hidden // self.n_heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, self.n_heads, self.n_kv, bias, tp, dtype)
        self.o_proj = RowParallelLinear(self.n_heads * self.head_dim, hidden, bias, tp, dtype, unit=self.qkv_proj.o_unit)
        self.local_heads, self.local_kv = self.qkv_proj.local_heads, self.qkv_proj.local_kv
        self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"], dtype)

    def context_kv(self, ctx: torch.Tensor, rotary: RotaryEmbedding, cos_sin: CosSin) -> tuple[torch.Tensor, ...]:
        """ctx [T, H] (fc + hidden_norm output) -> k, v [T, Hkv, d] (k normed and rotated)."""
        q_size = self.qkv_proj.q_size
        bias = self.qkv_proj.bias[q_size:] if self.qkv_proj.bias is not None else None
        kv = F.linear(ctx, self.qkv_proj.weight[q_size:], bias)  # [T, 2 Hkv d]
        k, v = kv.view(-1, 2, self.local_kv, self.head_dim).unbind(1)  # [T, Hkv, d] each
        return rotary.apply(self.k_norm(k), *cos_sin), v

    def block_qkv(self, x: torch.Tensor, rotary: RotaryEmbedding, cos_sin: CosSin) -> tuple[torch.Tensor, ...]:
        """x [T, H] (input-layernormed block states) -> q [T, Hq, d], k, v [T, Hkv, d]."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.local_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.local_kv, self.head_dim))
        return rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin), v.view(-1, self.local_kv, self.head_dim)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_id: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.layer_id = layer_id
        self.self_attn = DFlashAttention(cfg, tp, dtype)
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], False, tp, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp, dtype)
        self.input_layernorm = RMSNorm(hidden, cfg["rms_norm_eps"], dtype)
        self.post_attention_layernorm = RMSNorm(hidden, cfg["rms_norm_eps"], dtype)
        k, gs = conv_settings(cfg)  # (0, 0): no convolution, no parameters
        self.attention_conv = GroupedDynamicCausalConv(hidden, k, gs, dtype) if k else None
        self.mlp_conv = GroupedDynamicCausalConv(hidden, k, gs, dtype) if k else None

    def attention_input(self, h: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [T, H] (blocks of ``block`` tokens) -> the attention's input [T, H] (input layernorm, then the
        convolution's first stage) and the convolution's second-stage kernel (None without one)."""
        return conv_prepare(self.attention_conv, self.input_layernorm(h), block)

    def attention_residual(self, h: torch.Tensor, attn: torch.Tensor, dyn: torch.Tensor | None,
                           block: int) -> torch.Tensor:
        """h + the attention output attn [T, H] after the convolution's second stage."""
        return h + conv_finish(self.attention_conv, attn, dyn, block)

    def mlp_residual(self, h: torch.Tensor, block: int) -> torch.Tensor:
        """h [T, H] + the (convolution-wrapped) SwiGLU MLP of its post-attention layernorm."""
        x, dyn = conv_prepare(self.mlp_conv, self.post_attention_layernorm(h), block)
        return h + conv_finish(self.mlp_conv, self.down_proj(silu_and_mul(self.gate_up_proj(x))), dyn, block)


class DFlashDraftModel(nn.Module):
    """Public API for the spec worker: ``block_size``, ``mask_token_id``, ``target_layer_ids``,
    ``kv_cache_layout()``, ``load_weights``, ``write_context``, ``forward``, ``forward_block`` (the graphed
    draft's); ``forward_train`` for training."""

    skip_weight_prefixes = ("embed_tokens.", "lm_head.", "model.embed_tokens.")

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        if tp.dcp_size > 1:
            raise ValueError("a DFlash drafter keeps its own unsharded KV cache: decode context parallelism is "
                             "the target's alone (build the drafter in drafter_group's group)")
        cfg, dtype = config.hf, config.dtype
        what = f"the DFlash drafter at {config.path or '(in-memory config)'}"
        check_no_candidate_selector(cfg, what)
        check_implemented(cfg, what)  # no other math-changing key this class does not implement (dflash_keys.py)
        self.attention_kinds = layer_attention(cfg, what)  # per layer: sliding window, block causality
        self.draft_window: int | None = None  # --speculative-dflash-draft-window-size: context cap, every layer
        self.config, self.tp, self.dtype = config, tp, dtype
        self.conv_kernel_size, self.conv_group_size = conv_settings(cfg)  # (0, 0): plain DFlash
        dcfg = cfg.get("dflash_config") or {}
        self.block_size = int(cfg.get("block_size") or dcfg.get("block_size") or 16)
        self.mask_token_id = int(dcfg["mask_token_id"])
        n_target = int(cfg.get("num_target_layers") or 0)
        ids = dcfg.get("target_layer_ids") or default_target_layer_ids(n_target, cfg["num_hidden_layers"])
        self.target_layer_ids: tuple[int, ...] = tuple(int(i) for i in ids)
        hidden = cfg["hidden_size"]
        self.hidden_size = hidden
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, i, tp, dtype) for i in range(cfg["num_hidden_layers"]))
        self.fc = ReplicatedLinear(len(self.target_layer_ids) * hidden, hidden, False, dtype)
        self.hidden_norm = RMSNorm(hidden, cfg["rms_norm_eps"], dtype)
        self.norm = RMSNorm(hidden, cfg["rms_norm_eps"], dtype)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(head_dim, rope_parameters(cfg), cfg.get("max_position_embeddings", 4096))

    def configure(self, draft_window: int | None, rope_attention_factor: float | None) -> None:
        """Serving settings: ``draft_window`` caps every layer's context at the last N tokens
        (``--speculative-dflash-draft-window-size``); ``rope_attention_factor`` replaces the YaRN attention factor
        derived from the config (``--speculative-dflash-rope-attention-factor``; ValueError for another rope)."""
        self.draft_window = draft_window
        if rope_attention_factor is not None:
            rope_type = rope_parameters(self.config.hf)["rope_type"]
            if rope_type != "yarn":
                raise ValueError(f"speculative_dflash_rope_attention_factor needs a drafter with YaRN rope; this "
                                 f"drafter's rope_type is {rope_type!r}")
            self.rotary.attention_factor = float(rope_attention_factor)

    def kv_cache_layout(self) -> KVCacheLayout:
        a = self.layers[0].self_attn
        return KVCacheLayout(len(self.layers), a.local_kv, a.head_dim, a.head_dim)

    def project_context(self, captured: torch.Tensor) -> torch.Tensor:
        """captured [..., n*H_target] -> hidden_norm(fc(captured)) [..., H]."""
        return self.hidden_norm(self.fc(captured.to(self.fc.weight.dtype)))

    @torch.no_grad()
    def write_context(self, captured: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                      kv: KVCache) -> None:
        """Store per-layer context K/V of tokens at ``positions`` in slots ``out_cache_loc``.
        captured [T, n*H_target] (ModelOutput.captured), positions [T], out_cache_loc [T]."""
        ctx = self.project_context(captured)  # [T, H]
        cos_sin = self.rotary.cos_sin(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(ctx, self.rotary, cos_sin)  # [T, Hkv, d]
            kv.k[i][out_cache_loc] = k.to(kv.dtype)
            kv.v[i][out_cache_loc] = v.to(kv.dtype)

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, kv: KVCache, backend: AttentionBackend) -> torch.Tensor:
        """Draft blocks over the paged context. ``fb.input_embeds`` [T, H] = target embeddings of
        ``[root, MASK...]`` per request; returns final-normed hidden states [T, H]."""
        if fb.input_embeds is None:
            raise ValueError("DFlash forward needs fb.input_embeds (the target's embeddings of the block)")
        h = fb.input_embeds.to(self.dtype)  # [T, H]
        n_tok, bs = h.shape[0], fb.batch_size
        blk = n_tok // bs if bs else n_tok  # the per-request block (uniform; speculative_block_size may set it)
        if self.conv_kernel_size and blk * bs != n_tok:
            raise ValueError(f"DFlash conv drafter needs equal blocks per request: {n_tok} tokens, {bs} requests")
        cos_sin = self.rotary.cos_sin(fb.positions)
        kinds: dict[DraftAttention, ForwardBatch] = {}  # one key list and mask per layer kind (dflash_window.py)
        planned = None
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            spec = self.attention_kinds[i]
            lfb = kinds.get(spec) or kinds.setdefault(spec, windowed_batch(fb, spec, self.draft_window))
            if lfb is not planned:  # one plan per run of layers of the same kind
                backend.begin_forward(lfb.attention_meta())
                planned = lfb
            x, dyn = layer.attention_input(h, blk)  # [T, H]
            q, k, v = a.block_qkv(x, self.rotary, cos_sin)
            o = backend.forward(q, k, v, kv.k[i], kv.v[i], lfb.out_cache_loc, lfb.kv_indices, lfb.attn_mask,
                                lfb.q_index, a.scale)  # [T, Hq, d]
            h = layer.mlp_residual(layer.attention_residual(h, a.o_proj(o.reshape(o.shape[0], -1)), dyn, blk), blk)
        return self.norm(h)

    @torch.no_grad()
    def forward_block(self, ids: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor,
                      cached: torch.Tensor, table: torch.Tensor, kv: KVCache,
                      max_context: int | None = None) -> torch.Tensor:
        """``forward`` over one block per request from device tensors alone (capturable: no read back, no
        value-dependent shape, no KV slot taken). ids [bs*B] (unused: the block's embeddings carry it; the
        simulated drafter reads them), embeds [bs*B, H] the target's embeddings of ``[root, MASK...]``,
        positions [bs*B] (``cached[b] + i``), idx / cached [bs] the requests' slot-table rows and context
        lengths, table the slot table; ``max_context``: a static bound on the contexts for the CPU reference
        (None: the table's width). Returns final-normed hidden states [bs*B, H]."""
        h = embeds.to(self.dtype)  # [T, H]
        bs = idx.shape[0]
        blk = h.shape[0] // bs if bs else h.shape[0]
        cos_sin = self.rotary.cos_sin(positions)
        # the CPU path is the torch reference; on CUDA the Triton kernel (its key loop bounded on the device)
        attend = functools.partial(dflash_block_attention_reference, max_context=max_context)
        if h.is_cuda:
            from ddtree_serve.kernels.triton_dflash_attention import triton_dflash_block_attention as attend
        for i, layer in enumerate(self.layers):
            a, spec = layer.self_attn, self.attention_kinds[i]
            x, dyn = layer.attention_input(h, blk)  # [T, H]
            q, k, v = a.block_qkv(x, self.rotary, cos_sin)  # [T, Hq, d], [T, Hkv, d] x 2
            k, v = k.to(kv.dtype), v.to(kv.dtype)  # the values the paged path reads back from its temporary slots
            o = attend(q, k, v, kv.k[i], kv.v[i], table, idx, cached, spec.window, spec.causal, self.draft_window,
                       a.scale)  # [T, Hq, d]
            h = layer.mlp_residual(layer.attention_residual(h, a.o_proj(o.reshape(o.shape[0], -1)), dyn, blk), blk)
        return self.norm(h)

    def forward_train(self, ctx_feats: torch.Tensor, ctx_positions: torch.Tensor, block_embeds: torch.Tensor,
                      block_positions: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """Dense path (training, no cache). ctx_feats [b, S, n*H_target], ctx_positions [b, S],
        block_embeds [b, Q, H], block_positions [b, Q], attn_mask [b, Q, S + Q] bool (query i may see
        key j; keys are the S context tokens then the Q block tokens; with a convolution, Q = N blocks of
        ``block_size`` laid out one after another). Each layer ANDs its window and causality terms
        (``dflash_window.visibility`` over the given positions) into ``attn_mask``; ``draft_window`` (then Q must
        be whole blocks of ``block_size``) hides context before each block's anchor - N. Returns [b, Q, H] final-normed."""
        b, s = ctx_positions.shape
        q_len, blk = block_positions.shape[1], self.block_size
        if self.conv_kernel_size and q_len % blk:
            raise ValueError(f"DFlash conv drafter: {q_len} block tokens are not whole blocks of {blk}")
        ctx = self.project_context(ctx_feats).reshape(b * s, -1)  # [b*S, H]
        cs_ctx = self.rotary.cos_sin(ctx_positions.reshape(-1))
        cs_blk = self.rotary.cos_sin(block_positions.reshape(-1))
        h = block_embeds.to(self.fc.weight.dtype).reshape(b * q_len, -1)  # [b*Q, H]
        key_pos = torch.cat([ctx_positions, block_positions], 1)  # [b, S+Q]
        if self.draft_window is not None:  # the cap: context keys at >= anchor - N (blocks of block_size)
            if q_len % blk:
                raise ValueError(f"draft_window needs whole blocks of {blk}; got {q_len} block tokens")
            anchor = block_positions.view(b, -1, blk)[:, :, :1].expand(-1, -1, blk).reshape(b, q_len)  # [b, Q]
            near = ctx_positions[:, None, :] >= anchor[:, :, None] - self.draft_window  # [b, Q, S]
            attn_mask = attn_mask & torch.cat([near, near.new_ones(b, q_len, q_len)], 2)
        masks = {spec: attn_mask if spec == DraftAttention() else attn_mask & visibility(block_positions, key_pos, spec)
                 for spec in set(self.attention_kinds)}  # [b, Q, S+Q] per layer kind
        for layer, spec in zip(self.layers, self.attention_kinds, strict=True):
            a = layer.self_attn
            kc, vc = a.context_kv(ctx, self.rotary, cs_ctx)  # [b*S, Hkv, d]
            x, dyn = layer.attention_input(h, blk)  # [b*Q, H]
            q, kb, vb = a.block_qkv(x, self.rotary, cs_blk)  # [b*Q, H*, d]
            keys = torch.cat([kc.view(b, s, a.local_kv, -1), kb.view(b, q_len, a.local_kv, -1)], 1)  # [b, S+Q, Hkv, d]
            vals = torch.cat([vc.view(b, s, a.local_kv, -1), vb.view(b, q_len, a.local_kv, -1)], 1)
            o = F.scaled_dot_product_attention(
                q.view(b, q_len, a.local_heads, -1).transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                attn_mask=masks[spec][:, None], scale=a.scale, enable_gqa=a.local_kv != a.local_heads,
            )  # [b, Hq, Q, d]
            h = layer.mlp_residual(layer.attention_residual(h, a.o_proj(o.transpose(1, 2).reshape(b * q_len, -1)),
                                                            dyn, blk), blk)
        return self.norm(h).view(b, q_len, -1)

    _STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
                ("mlp.gate_proj", "gate_up_proj", 0), ("mlp.up_proj", "gate_up_proj", 1),
                ("mlp.down_proj", "down_proj", None))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """z-lab names: ``layers.N.self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``,
        ``layers.N.mlp.{gate,up,down}_proj``, layernorms, ``fc``, ``hidden_norm``, ``norm``; with a convolution
        also ``layers.N.{attention,mlp}_conv.base_kernel`` and ``.kernel_projection.weight``."""
        load_named_weights(dict(self.named_parameters()), weights, self._STACKED, "DFlash checkpoint",
                           skip_prefixes=self.skip_weight_prefixes)
