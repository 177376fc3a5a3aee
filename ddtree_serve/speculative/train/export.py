"""Export of a trained DFlash drafter in the z-lab checkpoint format (docs/DESIGN.md 4.5): config.json for
a target, and bf16 safetensors under z-lab names (un-merged q/k/v and gate/up). Inference loading lives in
``ddtree_serve/model_executor/models/dflash.py``; this is the training side's writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ddtree_serve.model_executor.model_config import rope_parameters
from ddtree_serve.model_executor.models.dflash import DFlashDraftModel


def zlab_state_dict(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """Weights under z-lab names (un-merged q/k/v and gate/up); single TP rank only."""
    if model.tp.size != 1:
        raise ValueError("saving a drafter needs tp_size 1")
    out: dict[str, torch.Tensor] = {"fc.weight": model.fc.weight, "hidden_norm.weight": model.hidden_norm.weight,
                                    "norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        a, p = layer.self_attn, f"layers.{i}."
        for part, t in zip(("q", "k", "v"), a.qkv_proj.weight.split(
                [a.qkv_proj.q_size, a.qkv_proj.kv_size, a.qkv_proj.kv_size]), strict=True):
            out[f"{p}self_attn.{part}_proj.weight"] = t
        if a.qkv_proj.bias is not None:
            for part, t in zip(("q", "k", "v"), a.qkv_proj.bias.split(
                    [a.qkv_proj.q_size, a.qkv_proj.kv_size, a.qkv_proj.kv_size]), strict=True):
                out[f"{p}self_attn.{part}_proj.bias"] = t
        out[f"{p}self_attn.o_proj.weight"] = a.o_proj.weight
        if a.o_proj.bias is not None:
            out[f"{p}self_attn.o_proj.bias"] = a.o_proj.bias
        out[f"{p}self_attn.q_norm.weight"] = a.q_norm.weight
        out[f"{p}self_attn.k_norm.weight"] = a.k_norm.weight
        gate, up = layer.gate_up_proj.weight.chunk(2, dim=0)
        out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate, up
        out[f"{p}mlp.down_proj.weight"] = layer.down_proj.weight
        out[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight
        out[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for name in ("attention_conv", "mlp_conv"):  # the optional convolution (dflash_conv.py), z-lab's names
            conv = getattr(layer, name)
            if conv is not None:
                out[f"{p}{name}.base_kernel"] = conv.base_kernel
                out[f"{p}{name}.kernel_projection.weight"] = conv.kernel_projection.weight
    return out


def drafter_config(target_hf: dict[str, Any], num_layers: int, block_size: int, target_layer_ids: list[int],
                   mask_token_id: int, conv_kernel_size: int = 0, conv_group_size: int = 16,
                   num_kv_heads: int = 0) -> dict[str, Any]:
    """A z-lab-format config.json for a drafter of ``target_hf`` (hidden/heads/MLP width from the target;
    ``num_kv_heads`` > 0 replaces the target's KV head count: a divisor of the query heads).
    ``conv_kernel_size`` > 0 adds DFlash2's grouped dynamic convolution (``dflash_config.conv_kernel_size`` /
    ``conv_group_size``; models/dflash_conv.py); 0 writes a plain DFlash config (no conv keys)."""
    hidden = int(target_hf["hidden_size"])
    heads = int(target_hf["num_attention_heads"])
    rope = rope_parameters(target_hf)
    kv_heads = num_kv_heads or int(target_hf.get("num_key_value_heads", heads))
    if num_kv_heads < 0 or heads % kv_heads:
        raise ValueError(f"--num-kv-heads {num_kv_heads} does not divide the {heads} attention heads")
    dflash: dict[str, Any] = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    if conv_kernel_size > 0:
        if conv_group_size <= 0 or hidden % conv_group_size:
            raise ValueError(f"--conv-group-size {conv_group_size} does not divide the hidden size {hidden}")
        dflash.update(conv_kernel_size=int(conv_kernel_size), conv_group_size=int(conv_group_size))
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": int(target_hf["intermediate_size"]),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": int(target_hf.get("head_dim") or hidden // heads), "num_hidden_layers": num_layers,
        "layer_types": ["full_attention"] * num_layers, "rms_norm_eps": float(target_hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope["rope_theta"]), "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "max_position_embeddings": int(target_hf.get("max_position_embeddings", 4096)),
        "vocab_size": int(target_hf["vocab_size"]), "tie_word_embeddings": bool(target_hf.get("tie_word_embeddings")),
        "use_sliding_window": False, "sliding_window": None, "dtype": "bfloat16",
        "block_size": block_size, "num_target_layers": int(target_hf["num_hidden_layers"]),
        "dflash_config": dflash,
    }


def save_drafter(model: DFlashDraftModel, config_dict: dict[str, Any], out_dir: str | Path) -> Path:
    """Write ``model.safetensors`` (bf16, z-lab names) and ``config.json``; returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in zlab_state_dict(model).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return out
