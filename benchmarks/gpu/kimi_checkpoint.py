"""A random-weight Kimi K2.6-shaped checkpoint, made where it runs (no download): the real Hugging Face layout
of ``moonshotai/Kimi-K2.6`` (``KimiK25ForConditionalGeneration`` wrapping a DeepSeek-V3 text model under
``language_model.*``, its config under ``text_config``; routed experts as compressed-tensors
``pack-quantized`` INT4, group 32, symmetric, everything else bfloat16; sharded ``model-0000k-of-0000n
.safetensors`` files with ``model.safetensors.index.json``), at one rank's shapes under TP 8.

``KimiShape`` holds the sizes. ``KimiShape.tp8()`` is what one GPU of an 8-GPU Kimi K2.6 deployment computes
per layer: MLA with kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, q_lora 1536,
64 / 8 = 8 heads, hidden 7168; the dense MLP's intermediate 18432 / 8; all 384 routed experts with each one's
intermediate 2048 / 8 (top-8, one shared expert, sigmoid + noaux_tc routing) and the vocabulary's shard
163840 / 8, in ``layers`` layers (layer 0 dense, the rest MoE). ``KimiShape.tiny()`` is the same layout at
sizes a CPU test loads in seconds.

Weights are drawn on ``device`` (a GPU when there is one: the 384-expert layer is 1.2 GB of INT4) with a
seeded generator: dense weights ``N(0, 1/fan_in)`` (the lm_head 3x wider, so greedy logits have no near-ties),
norms 1, packed expert words uniformly random bits (every nibble a valid int4 value) with one scale per group
giving the same ``1/fan_in`` variance. A tokenizer is not written: the engine then serves token ids only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

GROUP = 32  # compressed-tensors group size of Kimi's INT4 experts
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
          "re:vision_tower.*", "re:mm_projector.*"]  # Kimi K2.6's quantization_config.ignore


@dataclass(frozen=True)
class KimiShape:
    """Sizes of the checkpoint (defaults: one rank of Kimi K2.6 under TP 8, two layers)."""

    layers: int = 2
    hidden: int = 7168
    heads: int = 8
    q_lora: int = 1536
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    v_head: int = 128
    intermediate: int = 18432 // 8
    experts: int = 384
    moe_intermediate: int = 2048 // 8
    top_k: int = 8
    vocab: int = 163840 // 8
    max_positions: int = 262144

    @classmethod
    def tp8(cls, layers: int = 2) -> KimiShape:
        return cls(layers=layers)

    @classmethod
    def tiny(cls, layers: int = 2) -> KimiShape:
        """The same layout at CPU-test sizes (MLA widths kept proportional; group 32 still divides every
        expert input width)."""
        return cls(layers=layers, hidden=64, heads=2, q_lora=32, kv_lora=32, nope=16, rope=8, v_head=16,
                   intermediate=96, experts=8, moe_intermediate=32, top_k=2, vocab=512, max_positions=4096)

    def text_config(self) -> dict[str, Any]:
        """The ``text_config`` with Kimi K2.6's field spellings and values (rope, routing, norms)."""
        return dict(
            architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=self.vocab,
            hidden_size=self.hidden, intermediate_size=self.intermediate,
            moe_intermediate_size=self.moe_intermediate, num_hidden_layers=self.layers, first_k_dense_replace=1,
            num_attention_heads=self.heads, num_key_value_heads=self.heads, q_lora_rank=self.q_lora,
            kv_lora_rank=self.kv_lora, qk_nope_head_dim=self.nope, qk_rope_head_dim=self.rope,
            v_head_dim=self.v_head, n_routed_experts=self.experts, num_experts_per_tok=self.top_k,
            n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
            scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, hidden_act="silu",
            rms_norm_eps=1e-5, max_position_embeddings=self.max_positions, rope_theta=50000.0,
            rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=self.vocab - 1,
            num_nextn_predict_layers=0, torch_dtype="bfloat16")

    def nbytes(self) -> int:
        """Approximate checkpoint size in bytes (bf16 dense, INT4 experts with bf16 scales)."""
        h, d = self.hidden, self.heads
        attn = h * self.q_lora + self.q_lora * d * (self.nope + self.rope) + h * (self.kv_lora + self.rope) \
            + self.kv_lora * d * (self.nope + self.v_head) + d * self.v_head * h
        dense = 2 * (attn + 3 * h * self.intermediate)
        moe = 2 * (attn + 3 * h * self.moe_intermediate + self.experts * h) \
            + self.experts * 3 * h * self.moe_intermediate * (0.5 + 2 / GROUP)
        return int(2 * 2 * self.vocab * h + dense + (self.layers - 1) * moe)


def quantization_config() -> dict[str, Any]:
    """Kimi K2.6's ``quantization_config`` (compressed-tensors, pack-quantized INT4 W4A16, group 32)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "output_activations": None, "weights": weights}},
            "ignore": IGNORE, "kv_cache_scheme": None}


class _Draw:
    """Seeded random tensors on one device, returned on the CPU for saving."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def dense(self, out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        w = torch.randn(out, inp, generator=self.gen, device=self.device) * (gain / math.sqrt(inp))
        return w.to(torch.bfloat16).cpu()

    def norm(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    def int4(self, out: int, inp: int) -> dict[str, torch.Tensor]:
        """One pack-quantized linear: random words (nibbles uniform in [0, 15], i.e. q in [-8, 7], mean -0.5,
        std ~4.6) and the scale giving weights of std 1/sqrt(inp)."""
        words = torch.randint(-(2**31), 2**31 - 1, (out, inp // 8), generator=self.gen, device=self.device,
                              dtype=torch.int64).to(torch.int32)
        scale = torch.full((out, inp // GROUP), 1.0 / (4.6 * math.sqrt(inp)), dtype=torch.bfloat16)
        return {"weight_packed": words.cpu(), "weight_scale": scale,
                "weight_shape": torch.tensor([out, inp], dtype=torch.int64)}


def _layer(shape: KimiShape, i: int, draw: _Draw) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer ``i``'s tensors under DeepseekV3ForCausalLM's names (without the wrapper's prefix)."""
    h, d, p = shape.hidden, shape.heads, f"model.layers.{i}."
    yield p + "input_layernorm.weight", draw.norm(h)
    yield p + "post_attention_layernorm.weight", draw.norm(h)
    a = p + "self_attn."
    yield a + "q_a_proj.weight", draw.dense(shape.q_lora, h)
    yield a + "q_a_layernorm.weight", draw.norm(shape.q_lora)
    yield a + "q_b_proj.weight", draw.dense(d * (shape.nope + shape.rope), shape.q_lora)
    yield a + "kv_a_proj_with_mqa.weight", draw.dense(shape.kv_lora + shape.rope, h)
    yield a + "kv_a_layernorm.weight", draw.norm(shape.kv_lora)
    yield a + "kv_b_proj.weight", draw.dense(d * (shape.nope + shape.v_head), shape.kv_lora)
    yield a + "o_proj.weight", draw.dense(h, d * shape.v_head)
    if i == 0:  # first_k_dense_replace = 1
        for m, n in ((p + "mlp.", shape.intermediate),):
            yield m + "gate_proj.weight", draw.dense(n, h)
            yield m + "up_proj.weight", draw.dense(n, h)
            yield m + "down_proj.weight", draw.dense(h, n)
        return
    n = shape.moe_intermediate
    s = p + "mlp.shared_experts."
    yield s + "gate_proj.weight", draw.dense(n, h)
    yield s + "up_proj.weight", draw.dense(n, h)
    yield s + "down_proj.weight", draw.dense(h, n)
    yield p + "mlp.gate.weight", draw.dense(shape.experts, h)
    yield p + "mlp.gate.e_score_correction_bias", torch.zeros(shape.experts, dtype=torch.float32)
    for e in range(shape.experts):
        m = p + f"mlp.experts.{e}."
        for proj, (o, k) in (("gate_proj", (n, h)), ("up_proj", (n, h)), ("down_proj", (h, n))):
            for suffix, t in draw.int4(o, k).items():
                yield f"{m}{proj}.{suffix}", t


def write_kimi_checkpoint(path: str | Path, shape: KimiShape | None = None, device: str | None = None,
                          seed: int = 0) -> dict[str, Any]:
    """Write the checkpoint (module docstring) into ``path``; returns facts about it (sizes, files, seconds
    are the caller's). ``device``: where weights are drawn (default CUDA when available)."""
    from safetensors.torch import save_file

    shape = shape or KimiShape.tp8()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    draw = _Draw(dev, seed)
    text = shape.text_config()
    prefix = "language_model."
    shards: list[dict[str, torch.Tensor]] = [{
        prefix + "model.embed_tokens.weight": draw.dense(shape.vocab, shape.hidden, gain=math.sqrt(shape.hidden)),
        prefix + "model.norm.weight": draw.norm(shape.hidden),
        prefix + "lm_head.weight": draw.dense(shape.vocab, shape.hidden, gain=3.0),
        # a text-only wrapper: the tower's tensors are there (as in K2.6) and loaders skip them
        "vision_tower.patch_embed.proj.weight": torch.zeros(8, 3, 2, 2, dtype=torch.bfloat16),
        "mm_projector.proj.0.weight": torch.zeros(shape.hidden, 8, dtype=torch.bfloat16),
    }]
    for i in range(shape.layers):
        shards.append({prefix + k: v for k, v in _layer(shape, i, draw)})
    weight_map: dict[str, str] = {}
    total = 0
    for k, tensors in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text, "vision_config": {"hidden_size": 8, "patch_size": 2, "num_hidden_layers": 1},
              "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
              "quantization_config": quantization_config()}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {"path": str(out), "bytes": total, "tensors": len(weight_map), "files": len(shards),
            "drawn_on": str(dev), "shape": asdict(shape)}


def write_drafter(target: str | Path, out: str | Path, block_size: int = 8, head_dim: int = 128) -> str:
    """A one-layer random DFlash drafter for ``target`` (tests/speculative/drafter_utils.py's writer, with
    128-wide heads instead of hidden / heads)."""
    from tests.speculative.drafter_utils import write_random_drafter

    return write_random_drafter(str(target), out, num_layers=1, block_size=block_size, head_dim=head_dim)
