"""A tiny random MoonViT vision tower + patch-merger projector in Kimi K2.5 / K2.6's checkpoint layout.

``tiny_vision_config(text_hidden)`` is a ``vision_config`` with the published key spellings (patch 14, 2x2
merge, as in the real model; small widths: hidden 32, 2 heads of 16, 2 layers, MLP 64, an 8x8 position
table, so images of other grids exercise the bicubic resize). ``random_vision_state`` gives float32 weights
(BF16-representable) under the checkpoint's tensor names (``vision_tower.*``, ``mm_projector.*``).
"""

from __future__ import annotations

from typing import Any

import torch


def tiny_vision_config(text_hidden: int, **overrides: Any) -> dict[str, Any]:
    vc: dict[str, Any] = dict(
        patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
        pos_emb_type="divided_fixed", vt_num_attention_heads=2, vt_num_hidden_layers=2, vt_hidden_size=32,
        vt_intermediate_size=64, merge_kernel_size=[2, 2], video_attn_type="spatial_temporal", merge_type="sd2_tpool",
        mm_projector_type="patchmerger", mm_hidden_size=32, projector_hidden_act="gelu", projector_ln_eps=1e-5,
        text_hidden_size=text_hidden, model_type="")
    vc.update(overrides)
    return vc


def random_vision_state(vc: dict[str, Any], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).bfloat16().float()

    def ln(prefix: str, n: int) -> dict[str, torch.Tensor]:
        return {prefix + ".weight": (1.0 + rnd(n, std=0.1)).bfloat16().float(), prefix + ".bias": rnd(n, std=0.05)}

    d, inter, p = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["patch_size"]
    m = d * vc["merge_kernel_size"][0] * vc["merge_kernel_size"][1]
    t = vc["text_hidden_size"]
    sd = {"vision_tower.patch_embed.proj.weight": rnd(d, 3, p, p, std=0.05),
          "vision_tower.patch_embed.proj.bias": rnd(d, std=0.05),
          "vision_tower.patch_embed.pos_emb.weight": rnd(vc["init_pos_emb_height"], vc["init_pos_emb_width"], d,
                                                         std=0.3)}
    for i in range(vc["vt_num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        sd |= ln(b + "norm0", d) | ln(b + "norm1", d)
        sd[b + "wqkv.weight"], sd[b + "wqkv.bias"] = rnd(3 * d, d, std=0.25), rnd(3 * d, std=0.05)
        sd[b + "wo.weight"], sd[b + "wo.bias"] = rnd(d, d, std=0.15), rnd(d, std=0.05)
        sd[b + "mlp.fc0.weight"], sd[b + "mlp.fc0.bias"] = rnd(inter, d, std=0.15), rnd(inter, std=0.05)
        sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc1.bias"] = rnd(d, inter, std=0.15), rnd(d, std=0.05)
    sd |= ln("vision_tower.encoder.final_layernorm", d) | ln("mm_projector.pre_norm", d)
    sd["mm_projector.proj.0.weight"], sd["mm_projector.proj.0.bias"] = rnd(m, m, std=0.1), rnd(m, std=0.05)
    # large enough that an image moves the text model's answer
    sd["mm_projector.proj.2.weight"], sd["mm_projector.proj.2.bias"] = rnd(t, m, std=0.3), rnd(t, std=0.1)
    return sd
