"""Tiny random DeepSeek-V3 / Kimi K2.x checkpoints in the exact Hugging Face layout, for tests.

- ``write_tiny_deepseek(path)``: ``DeepseekV3ForCausalLM`` (Kimi K2 layout), BF16 safetensors, per-expert
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``.
- ``int4=True``: routed experts as compressed-tensors pack-quantized INT4 (``weight_packed`` int32,
  ``weight_scale`` BF16, ``weight_shape``; group 32, symmetric) with a Kimi-style ``quantization_config``.
- ``kimi=True``: the ``KimiK25ForConditionalGeneration`` wrapper (``text_config``, ``language_model.*``
  weights) with a dummy ``vision_tower.*`` / ``mm_projector.*`` tensor that loaders must skip (an incomplete
  ``vision_config``: a text-only wrapper); with ``vision=True`` instead a real tiny MoonViT tower and
  projector (tests/model_executor/tiny_moonvit.py) and ``media_placeholder_token_id`` = ``media_token_id``.
- ``write_reference(tiny, path)``: the same model as a plain float32 ``DeepseekV3ForCausalLM`` holding the
  weights exactly as served (INT4 experts dequantized), for ``transformers.AutoModelForCausalLM``.

Every checkpoint also gets a small word-level test tokenizer (``<0> <1> ...``) so the Engine can open it;
it is a stand-in for tests only, not Kimi's tokenizer. Shape: 3 layers (layer 0 dense), 8 experts in 2
groups (topk_group 1), top-2, 1 shared expert, MLA q_lora 32 / kv_lora 32 / nope 16 / rope 8 / v 16,
YaRN (factor 64, mscale_all_dim 1), vocab 512.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ddtree_serve.model_executor.quantization.int4_pack import dequantize_int4, pack_quantized

VOCAB = 512
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:vision_tower.*", "re:mm_projector.*"]


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    """A DeepSeek-V3 text config with Kimi K2.6's field spellings (legacy ``rope_scaling`` + ``rope_theta``)."""
    cfg: dict[str, Any] = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, scoring_func="sigmoid",
        topk_method="noaux_tc", moe_layer_freq=1, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_theta=50000.0, rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 64,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=VOCAB - 1,
        num_nextn_predict_layers=0, torch_dtype="bfloat16")
    cfg.update(overrides)
    return cfg


def random_state_dict(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights (already BF16-representable) under DeepseekV3ForCausalLM's checkpoint names."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).bfloat16().float()

    def norm(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g) * 0.1).bfloat16().float()

    h, heads, inter, moe = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"], \
        cfg["moe_intermediate_size"]
    qk, lora, rope = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    sd = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h, std=0.5), "model.norm.weight": norm(h),
          "lm_head.weight": rnd(cfg["vocab_size"], h, std=0.3)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "post_attention_layernorm.weight"] = norm(h)
        a = p + "self_attn."
        sd[a + "q_a_proj.weight"] = rnd(cfg["q_lora_rank"], h)
        sd[a + "q_a_layernorm.weight"] = norm(cfg["q_lora_rank"])
        sd[a + "q_b_proj.weight"] = rnd(heads * qk, cfg["q_lora_rank"], std=0.2)
        sd[a + "kv_a_proj_with_mqa.weight"] = rnd(lora + rope, h)
        sd[a + "kv_a_layernorm.weight"] = norm(lora)
        sd[a + "kv_b_proj.weight"] = rnd(heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), lora, std=0.2)
        sd[a + "o_proj.weight"] = rnd(h, heads * cfg["v_head_dim"])
        mlps = [(p + "mlp.", inter)] if i < cfg["first_k_dense_replace"] else \
            [(p + f"mlp.experts.{e}.", moe) for e in range(cfg["n_routed_experts"])] + \
            [(p + "mlp.shared_experts.", moe * cfg["n_shared_experts"])]
        for m, n in mlps:
            sd[m + "gate_proj.weight"] = rnd(n, h, std=0.15)
            sd[m + "up_proj.weight"] = rnd(n, h, std=0.15)
            sd[m + "down_proj.weight"] = rnd(h, n, std=0.15)
        if i >= cfg["first_k_dense_replace"]:
            sd[p + "mlp.gate.weight"] = rnd(cfg["n_routed_experts"], h, std=0.3)
            sd[p + "mlp.gate.e_score_correction_bias"] = torch.randn(cfg["n_routed_experts"], generator=g) * 0.1
    return sd


@dataclass
class TinyCheckpoint:
    path: str
    text_config: dict[str, Any]
    served_state: dict[str, torch.Tensor]  # DeepseekV3 names, float32, INT4 experts dequantized
    vision_state: dict[str, torch.Tensor] = field(default_factory=dict)  # vision=True: its float32 weights


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def write_tokenizer(path: str | Path, vocab: int = VOCAB) -> None:
    """A word-level test tokenizer over ``<0> .. <vocab-1>`` (eos = the last id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token="<0>",
                                   eos_token=f"<{vocab - 1}>")
    fast.save_pretrained(str(path))


def write_tiny_deepseek(path: str | Path, *, int4: bool = False, kimi: bool = False, seed: int = 0,
                        vision: bool = False, media_token_id: int | None = None, **overrides: Any) -> TinyCheckpoint:
    """Write a tiny checkpoint (see module docstring) and return what a correct loader must serve."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = tiny_text_config(**overrides)
    dense = random_state_dict(text, seed)
    served: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, w in dense.items():
        if int4 and _is_routed_expert(name):
            parts = pack_quantized(w.bfloat16(), group_size=32)
            module = name.removesuffix(".weight")
            for suffix, t in parts.items():
                tensors[f"{module}.{suffix}"] = t
            served[name] = dequantize_int4(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                                           torch.float32)
        else:
            keep_fp32 = name.endswith("e_score_correction_bias")
            tensors[name] = w.float() if keep_fp32 else w.bfloat16()
            served[name] = w.float()
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                        "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                    "strategy": "group", "group_size": 32, "dynamic": False,
                                                    "actorder": None, "observer": "minmax"}}},
          "ignore": KIMI_IGNORE, "kv_cache_scheme": None}
    if kimi:
        tensors = {f"language_model.{k}": v for k, v in tensors.items()}
        vision_cfg: dict[str, Any] = {"hidden_size": 8, "patch_size": 2, "num_hidden_layers": 1}
        if vision:
            from tests.model_executor.tiny_moonvit import random_vision_state, tiny_vision_config

            vision_cfg = tiny_vision_config(text["hidden_size"])
            vision_state = random_vision_state(vision_cfg, seed + 1)
            tensors |= {k: v.bfloat16() for k, v in vision_state.items()}
        else:
            tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2, dtype=torch.bfloat16)
            tensors["mm_projector.proj.0.weight"] = torch.zeros(text["hidden_size"], 8, dtype=torch.bfloat16)
        full: dict[str, Any] = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                                "text_config": dict(text, model_type="kimi_k2"), "vision_config": vision_cfg,
                                "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]}
        if media_token_id is not None:
            full["media_placeholder_token_id"] = media_token_id
    else:
        full = dict(text)
    if int4:
        full["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(full, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(path, text["vocab_size"])
    return TinyCheckpoint(str(path), text, served, vision_state if kimi and vision else {})


def write_reference(tiny: TinyCheckpoint, path: str | Path) -> str:
    """The served weights as a float32 DeepseekV3ForCausalLM checkpoint transformers can load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(tiny.text_config, torch_dtype="float32"), indent=2))
    save_file({k: v.contiguous() for k, v in tiny.served_state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(path, tiny.text_config["vocab_size"])
    return str(path)
